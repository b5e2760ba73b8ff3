"""Speed benchmark: the project against what a user would otherwise run.

Each case runs in its own child process (so it reports its own peak RSS), the cases interleaved
over ``--repeats`` rounds, medians reported:

- synthesis: the project's loop (fedbip_flwr.synthesis: ``denoise`` + ``decode_latents``) against
  the stock ``StableDiffusionPipeline`` given the same z(T) (``latents=``), the same prompt
  embeddings (``prompt_embeds=``, ``negative_prompt_embeds=``), steps, guidance and batch; both
  draw the same images (checked, max difference below). The project's loop is also timed in its
  CPU fast paths: bfloat16 autocast (half-precision on a bf16 CPU), channels_last, and
  ``torch.compile`` (compile time apart). GFLOP/s are counted with torch's flop counter and set
  against this machine's measured matmul peak.
- concept step: the project's concept-learning step (cached latents, Adam on the concept
  vectors only) against the diffusers textual-inversion recipe as its training script does it
  (VAE-encode the batch every step, the text encoder, AdamW over the whole token-embedding table,
  then every row but the learned ones restored), learning the same number of vectors.
- classifier: SGD steps/s of the shared recipe on uint8 shards, split into data preparation
  (reading rows, resizing, augmenting) and forward/backward; float32 and bf16 autocast.
- federation: the default ``flwr run`` (three clients), wall time per phase and peak RSS of the
  whole process tree, with Flower's default client resources (2 CPUs a client: one client at a
  time, two threads) and with one CPU a client (two clients at a time, one thread each).

    fedbip speed                                   # every case, 5 interleaved repeats
    fedbip speed --cases synth-stock,synth-project --repeats 3
    fedbip speed --device cuda --model /models/sd-v1-4 --image-size 512

On CUDA every case runs on the GPU: the "half" synthesis cases in fp16 (the project's
half-precision; ``synth-stock-half`` is the stock pipeline in fp16, what a GPU user runs), the
concept steps as a client runs them (the project: fp16 LDM, loss scaling; the recipe: its own
mixed precision, fp16 UNet and VAE, float32 text encoder, autocast), the classifier under fp16
autocast. ``scripts/gpu_check.sh`` runs them at SD v1-4's size with the architecture built by
``scripts/build_sd_architecture.py``. Writes ``benchmarks/perf.json`` (``--out``) and a section
of docs/benchmarks/speed.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedbip_flwr import results
from fedbip_flwr.paths import project_dir
from fedbip_flwr.sampler import SchedulerName

from .benchmark import write_section

ROOT = project_dir() or Path.cwd()  # the checkout: benchmarks/, BENCHMARKS.md, the app
MARKER = "speed"


# ------------------------------------------------------------------------- child: the cases
def _torch_setup(args: argparse.Namespace):
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    return torch


def synthesis_inputs(args: argparse.Namespace, ldm):
    """z(T) and prompt embeddings every synthesis case gets: the same tensors in each child."""
    import torch

    from fedbip_flwr import shapes
    from fedbip_flwr.concepts import unconditional_embedding
    from fedbip_flwr.synthesis import encode_texts

    generator = torch.Generator().manual_seed(1)
    latents = torch.randn((args.batch, *ldm.latent_shape(args.image_size)), generator=generator)
    prompts = [
        f"a sketch of a {shapes.CLASSES[i % len(shapes.CLASSES)]}" for i in range(args.batch)
    ]
    cond = encode_texts(ldm, prompts)
    uncond = unconditional_embedding(ldm).expand_as(cond)
    return latents.to(ldm.device, ldm.dtype), cond, uncond


def load(
    args: argparse.Namespace, *, half: bool, channels_last: bool = False, compile_unet: bool = False
):
    from fedbip_flwr.ldm import load_for_run

    return load_for_run(
        args.model,
        args.device,
        half,
        args.image_size,
        channels_last=channels_last,
        compile_unet=compile_unet,
    )


def project_images(args: argparse.Namespace, ldm, latents, cond, uncond):
    from fedbip_flwr.sampler import Sampler
    from fedbip_flwr.synthesis import decode_latents, denoise

    sampler = Sampler.create(args.scheduler, ldm.scheduler, args.steps)
    z0 = denoise(ldm, latents, cond, uncond[:1], sampler, sampler.first_timestep(), args.guidance)
    return (decode_latents(ldm, z0, args.batch) + 1) / 2  # [0, 1], as the pipeline returns


def stock_images(args: argparse.Namespace, ldm, latents, cond, uncond):
    from diffusers import StableDiffusionPipeline

    from fedbip_flwr.sampler import Sampler

    pipe = StableDiffusionPipeline(
        vae=ldm.vae,
        text_encoder=ldm.text_encoder,
        tokenizer=ldm.tokenizer,
        unet=ldm.unet,
        scheduler=Sampler.create(args.scheduler, ldm.scheduler, args.steps).scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        prompt_embeds=cond,
        negative_prompt_embeds=uncond,
        latents=latents,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        height=args.image_size,
        width=args.image_size,
        output_type="pt",
    )
    return out.images.float().cpu()


def timed(fn, *inputs, warmup: int = 1):
    """(seconds of one call after ``warmup`` untimed calls, its result, first call's seconds)."""
    import torch

    started = time.perf_counter()
    result = fn(*inputs)
    first = time.perf_counter() - started
    for _ in range(warmup - 1):
        result = fn(*inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn(*inputs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started, result, first


SYNTH_VARIANTS = {
    "synth-stock": {"half": False, "stock": True},
    "synth-stock-half": {"half": True, "stock": True},  # what a GPU user runs: fp16 weights
    "synth-project": {"half": False},
    "synth-project-half": {"half": True},
    "synth-project-half-cl": {"half": True, "channels_last": True},
    "synth-project-half-compile": {"half": True, "compile_unet": True},
}


def case_synthesis(args: argparse.Namespace, name: str) -> dict:
    """Images/s of one synthesis variant; on CUDA ``half`` is fp16 weights, on a bf16 CPU bf16
    autocast (the project's half-precision either way)."""
    _torch_setup(args)
    variant = dict(SYNTH_VARIANTS[name])
    stock = variant.pop("stock", False)
    ldm = load(args, **variant)
    latents, cond, uncond = synthesis_inputs(args, ldm)
    run = stock_images if stock else project_images
    seconds, images, first = timed(run, args, ldm, latents, cond, uncond)
    return {
        "seconds": seconds,
        "images": len(images),
        "images_per_s": len(images) / seconds,
        "first_call_seconds": first,
        "autocast": str(ldm.autocast),
        "dtype": str(ldm.dtype),
    }


def case_sampler_sweep(args: argparse.Namespace, _name: str) -> dict:
    """Images/s of every scheduler at each of ``--sweep-steps``, half precision, one model
    load: a sampler's cost is its UNet calls, so the figure to compare is steps, not names."""
    _torch_setup(args)
    ldm = load(args, half=True)
    latents, cond, uncond = synthesis_inputs(args, ldm)
    rows = {}
    for name in SchedulerName:
        for steps in (int(s) for s in args.sweep_steps.split(",")):
            setting = argparse.Namespace(**{**vars(args), "scheduler": name.value, "steps": steps})
            seconds, images, _ = timed(project_images, setting, ldm, latents, cond, uncond)
            rows[f"{name.value} {steps}"] = {
                "seconds": seconds,
                "images_per_s": len(images) / seconds,
            }
    return {"rows": rows, "dtype": str(ldm.dtype)}


def case_compile_bucket(args: argparse.Namespace, _name: str) -> dict:
    """A compiled UNet given a full batch, then a pass's smaller last batch padded to the full
    size (what synthesis does), then the same last batch unpadded: seconds of each call and
    the graphs dynamo has compiled after it."""
    torch = _torch_setup(args)
    from torch._dynamo.utils import counters

    from fedbip_flwr.sampler import Sampler
    from fedbip_flwr.synthesis import denoise

    ldm = load(args, half=True, compile_unet=True)
    latents, cond, uncond = synthesis_inputs(args, ldm)
    sampler = Sampler.create(args.scheduler, ldm.scheduler, args.steps)
    first, tail = sampler.first_timestep(), max(1, args.batch // 3)

    def call(n: int, pad_to: int | None) -> dict:  # one call, compile included: no warm-up
        started = time.perf_counter()
        denoise(ldm, latents[:n], cond[:n], uncond[:1], sampler, first, args.guidance, pad_to)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {
            "seconds": time.perf_counter() - started,
            "graphs": counters["stats"]["unique_graphs"],
        }

    calls = [
        ("full batch, first call", args.batch, None),
        ("full batch again", args.batch, None),
        (f"last batch of {tail}, padded", tail, args.batch),
        (f"last batch of {tail}, unpadded", tail, None),
        (f"last batch of {tail}, unpadded again", tail, None),
    ]
    return {"calls": {label: call(n, pad) for label, n, pad in calls}}


def case_synth_check(args: argparse.Namespace, _name: str) -> dict:
    """Do the stock pipeline and the project's loop draw the same images? And bf16 vs float32?
    Plus the FLOPs of one image (torch's flop counter) for GFLOP/s."""
    torch = _torch_setup(args)
    from torch.utils.flop_counter import FlopCounterMode

    exact = load(args, half=False)
    latents, cond, uncond = synthesis_inputs(args, exact)
    ours = project_images(args, exact, latents, cond, uncond)
    theirs = stock_images(args, exact, latents, cond, uncond)
    half = project_images(args, load(args, half=True), latents, cond, uncond)
    with FlopCounterMode(display=False) as counter:
        project_images(args, exact, latents[:1], cond[:1], uncond[:1])
    return {
        "max_abs_difference_stock_vs_project": float((ours - theirs).abs().max()),
        "mean_abs_difference_half_vs_float32": float((half - ours).abs().mean()),
        "max_abs_difference_half_vs_float32": float((half - ours).abs().max()),
        "gflop_per_image": counter.get_total_flops() / 1e9,
        "pixels_in_0_1": bool(ours.min() >= 0 and ours.max() <= 1),
        "torch_dtype": str(torch.float32),
    }


def case_matmul(args: argparse.Namespace, _name: str) -> dict:
    """This machine's matmul peak (2048 x 2048), float32 and bfloat16, GFLOP/s. bfloat16 only
    where the device computes it natively: a CPU without AVX512-BF16/AMX emulates it at well
    under 1 GFLOP/s (ten products had not finished after nine minutes on an AVX2 EPYC)."""
    torch = _torch_setup(args)
    from fedbip_flwr.ldm import cpu_has_bf16, select_device

    device = select_device(args.device)
    n = 8192 if device.type == "cuda" else 2048  # a GPU needs the larger product to reach its peak
    out: dict = {"bfloat16": None, "size": n}
    dtypes = (torch.float32, torch.bfloat16) + ((torch.float16,) if device.type == "cuda" else ())
    for dtype in dtypes:
        if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_has_bf16():
            continue
        a = torch.randn(n, n, dtype=dtype, device=device)
        times = []
        for _ in range(10):
            seconds, _, _ = timed(torch.matmul, a, a, warmup=0)
            times.append(seconds)
        out[str(dtype).removeprefix("torch.")] = 2 * n**3 / statistics.median(times) / 1e9
    return out


def concept_setup(args: argparse.Namespace):
    """A client's latents, labels and prompt layout as personalization has them."""
    import torch

    from fedbip_flwr import dataset
    from fedbip_flwr.concepts import prompt_layout
    from fedbip_flwr.config import FedBiPConfig
    from fedbip_flwr.instance import encode_images
    from fedbip_flwr.sampler import Sampler

    cfg = FedBiPConfig.from_flat(
        {
            "ldm.model": args.model,
            "classifier.init": "random",
            "synthesis.num-inference-steps": args.steps,
            "data.image-size": args.image_size,
        }
    )
    # as a client loads it: fp16 on CUDA (half-precision's default), float32 on the CPU
    ldm = load(args, half=cfg.ldm.half_precision)
    data = dataset.load_client_data(cfg.data_description, 0)
    images, labels = data.images[: args.concept_images], data.labels[: args.concept_images]
    z0 = encode_images(ldm.vae, images)
    layout = prompt_layout(
        ldm.tokenizer,
        cfg.data.prompt_template,
        cfg.data.n_s,
        cfg.data.n_v,
        data.domain,
        list(data.classes),
    )
    t_max = Sampler.create(args.scheduler, ldm.scheduler, args.steps).first_timestep()
    return torch, cfg, ldm, data, images, labels, z0, layout, t_max


def case_concept_project(args: argparse.Namespace, _name: str) -> dict:
    """Seconds per step of the project's concept learning (fedbip_flwr.concepts.learn_concepts)."""
    from fedbip_flwr.concepts import learn_concepts

    _torch_setup(args)
    torch, cfg, ldm, _data, _images, labels, z0, layout, t_max = concept_setup(args)
    own = cfg.settings_of("fedbip")

    def one_epoch():
        return learn_concepts(
            ldm,
            layout,
            own.concept_space,
            z0,
            labels,
            t_max,
            epochs=1,
            batch_size=own.concept_batch_size,
            lr=own.concept_lr,
            generator=torch.Generator().manual_seed(0),
        )

    seconds, _, _ = timed(one_epoch)
    steps = -(-len(labels) // own.concept_batch_size)
    return {
        "seconds_per_step": seconds / steps,
        "steps": steps,
        "vectors": layout.n_s + sum(layout.v_lengths.tolist()),
    }


def case_concept_recipe(args: argparse.Namespace, _name: str) -> dict:
    """Seconds per step of the textual-inversion recipe (diffusers' training example): new
    placeholder tokens in the tokenizer, their rows learned in the whole embedding table with
    AdamW, the VAE encoding the batch every step, every other row restored after each step."""
    _torch_setup(args)
    torch, cfg, ldm, data, images, labels, _z0, layout, t_max = concept_setup(args)
    own = cfg.settings_of("fedbip")
    from fedbip_flwr.concepts import plain_prompt

    tokenizer, text, table = ldm.tokenizer, ldm.text_encoder, None
    vectors = layout.n_s + sum(layout.v_lengths.tolist())  # as many vectors as the project learns
    names = [f"placeholderx{chr(97 + i % 26)}{chr(97 + i // 26)}" for i in range(vectors)]
    tokenizer.add_tokens(names)
    text.resize_token_embeddings(len(tokenizer))
    # The recipe's mixed precision (accelerate's "fp16"): VAE and UNet weights in fp16, the
    # trained text encoder in float32, the forward under autocast, the loss scaled.
    text.float()
    table = text.get_input_embeddings()
    table.weight.requires_grad_(True)
    new_ids = torch.tensor(tokenizer.convert_tokens_to_ids(names))
    keep = torch.ones(len(tokenizer), dtype=torch.bool)
    keep[new_ids] = False
    keep = keep.to(table.weight.device)
    original = table.weight.detach().clone()
    s_words = " ".join(names[: layout.n_s])
    v_words, at = [], layout.n_s
    for length in layout.v_lengths.tolist():
        v_words.append(" ".join(names[at : at + length]))
        at += length
    prompts = [plain_prompt(cfg.data.prompt_template, s_words, v_words[int(y)]) for y in labels]
    ids = tokenizer(
        prompts,
        padding="max_length",
        max_length=tokenizer.model_max_length,
        truncation=True,
        return_tensors="pt",
    ).input_ids
    optimizer = torch.optim.AdamW([table.weight], lr=own.concept_lr, weight_decay=0.0)
    scale = float(ldm.vae.config.scaling_factor)
    generator = torch.Generator().manual_seed(0)
    device, half = ldm.device, ldm.dtype == torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=half)

    def one_epoch():
        for batch in torch.randperm(len(labels), generator=generator).split(own.concept_batch_size):
            pixels = images[batch].to(device, ldm.dtype)
            z0 = ldm.vae.encode(pixels).latent_dist.sample(generator) * scale
            noise = torch.randn(z0.shape, generator=generator).to(device, z0.dtype)
            t = torch.randint(1, t_max + 1, (len(batch),), generator=generator).to(device)
            noisy = ldm.scheduler.add_noise(z0, noise, t)
            with torch.autocast(device.type, dtype=torch.float16, enabled=half):
                hidden = text(ids[batch].to(device))[0]
                pred = ldm.unet(noisy, t, encoder_hidden_states=hidden).sample
            loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            with torch.no_grad():
                table.weight[keep] = original[keep]

    seconds, _, _ = timed(one_epoch)
    steps = -(-len(labels) // own.concept_batch_size)
    return {
        "seconds_per_step": seconds / steps,
        "steps": steps,
        "vectors": vectors,
        "table_rows": len(tokenizer),
    }


def case_classifier(args: argparse.Namespace, name: str) -> dict:
    """SGD steps/s of the shared recipe on uint8 shards; data preparation timed apart."""
    torch = _torch_setup(args)
    from torch.utils.data import DataLoader

    from fedbip_flwr.classifier import (
        Precision,
        ShardImages,
        TrainSettings,
        _augment,
        _prepare,
        build_classifier,
        train_classifier,
    )
    from fedbip_flwr.ldm import select_device
    from fedbip_flwr.storage import write_tensors

    n, size = args.classifier_images, 64
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "shard.safetensors"
        write_tensors(
            shard,
            {
                "images": torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8),
                "labels": torch.arange(n) % 6,
            },
            {},
        )
        data = ShardImages([shard], size)
        settings = TrainSettings(
            epochs=1,
            lr=0.01,
            momentum=0.9,
            batch_size=64,
            image_size=size,
            steps=args.classifier_steps,
        )
        device = select_device(args.device)
        # on CUDA the recipe's "auto" precision (fp16 autocast, channels_last, loss scaling)
        precision = (
            Precision(torch.bfloat16, True)
            if name == "classifier-bf16"
            else Precision.for_device(device, "auto" if device.type == "cuda" else "float32", size)
        )

        def train():
            model = build_classifier(6, "random")
            train_classifier(
                model, data, None, settings, seed=0, device=device, precision=precision
            )

        def prepare_only():
            generator = torch.Generator().manual_seed(0)
            order = torch.randperm(n, generator=generator)[: args.classifier_steps * 64]
            for x, _y in DataLoader(data, sampler=list(order.split(64)), batch_size=None):
                x = _prepare(x.to(device), size)
                _augment(x, generator).contiguous(memory_format=precision.memory_format)
            if device.type == "cuda":
                torch.cuda.synchronize()

        total, _, _ = timed(train)
        prep, _, _ = timed(prepare_only)
    steps = args.classifier_steps
    return {
        "steps_per_s": steps / total,
        "seconds": total,
        "data_seconds": prep,
        "forward_backward_seconds": total - prep,
        "steps": steps,
        "precision": str(precision.autocast),
    }


FEDERATIONS = {
    "federation-2cpu": "client-resources-num-cpus=2",
    "federation-1cpu": "client-resources-num-cpus=1",
}


def case_federation(args: argparse.Namespace, name: str) -> dict:
    """The default `flwr run` with three clients: wall time, phases, peak RSS of every process."""
    import psutil

    from fedbip_tools.simulation import flwr_env, run_status, stop_local_superlink

    with tempfile.TemporaryDirectory() as tmp:
        home, out = Path(tmp) / "home", Path(tmp) / "outputs"
        home.mkdir()
        env = flwr_env(home, {"FEDBIP_PROJECT_DIR": str(ROOT)})
        command = [
            str(Path(sys.executable).with_name("flwr")),
            "run",
            str(ROOT),
            "--stream",
            "--run-config",
            f'output-dir="{out}" run-name="speed"',
            "--federation-config",
            f"num-supernodes=3 {FEDERATIONS[name]}",
        ]
        started = time.perf_counter()
        proc = subprocess.Popen(
            command, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        peak, me = 0, psutil.Process()
        while proc.poll() is None:
            procs = [p for p in psutil.process_iter(["cmdline"]) if p.pid != me.pid]
            ours = [p for p in procs if _belongs(p, str(home), proc.pid)]
            peak = max(peak, sum(_rss(p) for p in ours))
            time.sleep(0.25)
        wall = time.perf_counter() - started
        output = proc.stdout.read()
        run_id = int(output.split("Successfully started run ")[1].split()[0])
        status = run_status(home, run_id)
        stop_local_superlink(home)
        record = results.read(out / "speed")
    return {
        "wall_seconds": wall,
        "status": status,
        "phases": record.seconds.model_dump(exclude_none=True),
        "peak_rss_mb": peak / 2**20,
        "mean_accuracy": record.accuracy.mean,
    }


def _belongs(proc, home: str, flwr_pid: int) -> bool:
    """A process of this run: flwr run, or the SuperLink of this FLWR_HOME and all it started."""
    try:
        if proc.pid == flwr_pid or home in " ".join(proc.info["cmdline"] or []):
            return True
        return any(home in " ".join(p.cmdline()) for p in proc.parents())
    except Exception:  # noqa: BLE001 - processes come and go while we look
        return False


def _rss(proc) -> int:
    try:
        return proc.memory_info().rss
    except Exception:  # noqa: BLE001
        return 0


CASES = {
    **dict.fromkeys(SYNTH_VARIANTS, case_synthesis),
    "synth-check": case_synth_check,
    "sampler-sweep": case_sampler_sweep,
    "compile-bucket": case_compile_bucket,
    "matmul": case_matmul,
    "concept-project": case_concept_project,
    "concept-recipe": case_concept_recipe,
    "classifier": case_classifier,
    "classifier-bf16": case_classifier,
    **dict.fromkeys(FEDERATIONS, case_federation),
}
# Measured once, not repeated: checks, and the federations (minutes each on two cores).
ONCE = ("synth-check", "sampler-sweep", "compile-bucket", "matmul", *FEDERATIONS)


def child(args: argparse.Namespace) -> None:
    result = CASES[args.child](args, args.child)
    result["peak_rss_mb"] = (
        result.get("peak_rss_mb") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():  # what a smaller card must hold
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------- parent: orchestration
def run_child(args: argparse.Namespace, case: str) -> dict:
    forwarded = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("child", "cases", "repeats", "out", "no_write", "markdown") and v is not None
    ]
    command = [sys.executable, "-m", "fedbip_tools.speed", "--child", case, *forwarded]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"case {case} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def machine(args: argparse.Namespace) -> dict:
    import diffusers
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": args.threads,
        "device": args.device,
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "transformers": transformers.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def medians(samples: list[dict]) -> dict:
    out = {}
    for key, value in samples[0].items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(s[key] for s in samples)
        else:
            out[key] = value
    out["repeats"] = len(samples)
    return out


def default_cases(args: argparse.Namespace) -> list[str]:
    """Every case, less the bf16 classifier on a CPU that only emulates bf16 (it would time
    the emulation; ``--cases classifier-bf16`` still runs it)."""
    from fedbip_flwr.ldm import cpu_has_bf16, select_device

    if select_device(args.device).type == "cpu" and not cpu_has_bf16():
        print("classifier-bf16 left out: this CPU has no native bfloat16", flush=True)
        return [c for c in CASES if c != "classifier-bf16"]
    return list(CASES)


def measure(args: argparse.Namespace) -> dict:
    cases = [c for c in args.cases.split(",") if c] if args.cases else default_cases(args)
    unknown = set(cases) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    info = machine(args)
    samples: dict[str, list[dict]] = {c: [] for c in cases}
    for repeat in range(args.repeats):
        for case in cases:
            if case in ONCE and repeat:
                continue
            print(f"[{repeat + 1}/{args.repeats}] {case}", flush=True)
            samples[case].append(run_child(args, case))
    info["load_average_at_end"] = os.getloadavg()
    return {
        "machine": info,
        "settings": {k: v for k, v in vars(args).items() if k != "child"},
        "cases": {c: medians(s) for c, s in samples.items() if s},
        "samples": samples,
    }


def ratio(cases: dict, a: str, b: str, key: str) -> float | None:
    return cases[a][key] / cases[b][key] if a in cases and b in cases else None


def markdown(result: dict, command: str) -> str:
    c, m = result["cases"], result["machine"]
    gpu = f", GPU {m['gpu']}" if m.get("gpu") and m["device"] != "cpu" else ""
    lines = [
        "## Speed: the project against what a user would otherwise run",
        "",
        f"Command: `{command}`. Machine: {m['cpu']}, {m['cores']} cores{gpu}, {m['threads']} torch "
        f"threads per case, device {m['device']}; load average {m['load_average_at_start'][0]:.2f} "
        f"at the start, {m['load_average_at_end'][0]:.2f} at the end; torch {m['torch']}, "
        f"diffusers {m['diffusers']}, transformers {m['transformers']}; {m['date']}. Each case ran "
        f"in its own process, cases interleaved, medians of {result['settings']['repeats']} repeats "
        "(the federations and the checks: one run each).",
        "",
    ]
    peak = c.get("matmul", {})
    check = c.get("synth-check", {})
    if any(k in c for k in SYNTH_VARIANTS):
        s = result["settings"]
        lines += [
            f"Synthesis: {s['batch']} images of {s['image_size']} px, {s['steps']} PNDM steps, "
            f"guidance {s['guidance']}, from the same z(T) and prompt embeddings.",
            "",
            "| loop | images/s | vs stock float32 | GFLOP/s | first call (s) | peak RSS (MB; GPU where one ran) |",
            "|---|---|---|---|---|---|",
        ]
        for name in SYNTH_VARIANTS:
            if name not in c:
                continue
            e = c[name]
            gflops = (
                e["images_per_s"] * check["gflop_per_image"] if "gflop_per_image" in check else None
            )
            vs = ratio(c, name, "synth-stock", "images_per_s")
            gpu_mb = f" (GPU {e['peak_gpu_mb']:.0f})" if "peak_gpu_mb" in e else ""
            lines.append(
                f"| {name} | {e['images_per_s']:.2f} | {f'{vs:.2f}x' if vs else '–'} | "
                f"{f'{gflops:.1f}' if gflops else '–'} | {e['first_call_seconds']:.1f} | {e['peak_rss_mb']:.0f}{gpu_mb} |"
            )
        if check:
            lines += [
                "",
                f"Same work: the stock pipeline's images and the project's differ by at most "
                f"{check['max_abs_difference_stock_vs_project']:.1e} (pixels in [0, 1]); half "
                f"precision against float32: mean {check['mean_abs_difference_half_vs_float32']:.1e}, "
                f"max {check['max_abs_difference_half_vs_float32']:.1e}. One image is "
                f"{check['gflop_per_image']:.2f} GFLOP (torch's flop counter).",
            ]
        half = ratio(c, "synth-project-half", "synth-stock-half", "images_per_s")
        if half:
            lines += [
                "",
                f"In half precision the project's loop runs at {half:.2f}x the stock pipeline's.",
            ]
    if "sampler-sweep" in c:
        s = result["settings"]
        lines += [
            "",
            f"Samplers: {s['batch']} images of {s['image_size']} px, guidance {s['guidance']}, "
            "half precision, one warm-up call each.",
            "",
            "| scheduler, steps | images/s |",
            "|---|---|",
        ]
        lines += [
            f"| {k} | {v['images_per_s']:.2f} |" for k, v in c["sampler-sweep"]["rows"].items()
        ]
    if "compile-bucket" in c:
        lines += ["", "| compiled UNet call | seconds | graphs compiled so far |", "|---|---|---|"]
        lines += [
            f"| {k} | {v['seconds']:.2f} | {v['graphs']} |"
            for k, v in c["compile-bucket"]["calls"].items()
        ]
    if peak:  # also without synthesis cases: a matmul-only run reports its peak
        bf16 = (
            f"{peak['bfloat16']:.0f} GFLOP/s"
            if peak.get("bfloat16")
            else "not native on this CPU (not timed)"
        )
        fp16 = f"; float16 {peak['float16']:.0f} GFLOP/s" if peak.get("float16") else ""
        n = peak.get("size", 2048)
        lines.append(
            f"Matmul peak here ({n} x {n}): {peak['float32']:.0f} GFLOP/s float32; "
            f"bfloat16 {bf16}{fp16}."
        )
    if "concept-project" in c or "concept-recipe" in c:
        r = ratio(c, "concept-project", "concept-recipe", "seconds_per_step")
        lines += [
            "",
            "| concept step | s/step | vectors learned | peak RSS (MB; GPU where one ran) |",
            "|---|---|---|---|",
        ]
        for name in ("concept-project", "concept-recipe"):
            if name in c:
                e = c[name]
                gpu_mb = f" (GPU {e['peak_gpu_mb']:.0f})" if "peak_gpu_mb" in e else ""
                lines.append(
                    f"| {name} | {e['seconds_per_step']:.3f} | {e['vectors']} | {e['peak_rss_mb']:.0f}{gpu_mb} |"
                )
        if r:
            lines.append(
                f"\nThe project's step takes {r:.2f}x the textual-inversion recipe's time."
            )
    if "classifier" in c or "classifier-bf16" in c:
        lines += [
            "",
            "| classifier | steps/s | data prep (s) | forward/backward (s) | peak RSS (MB) |",
            "|---|---|---|---|---|",
        ]
        for name in ("classifier", "classifier-bf16"):
            if name in c:
                e = c[name]
                lines.append(
                    f"| {name} | {e['steps_per_s']:.2f} | {e['data_seconds']:.1f} | "
                    f"{e['forward_backward_seconds']:.1f} | {e['peak_rss_mb']:.0f} |"
                )
    for name, options in FEDERATIONS.items():
        if name in c:
            e = c[name]
            phases = ", ".join(f"{k} {v:.0f} s" for k, v in e["phases"].items())
            lines += [
                "",
                f'Default federation, `flwr run . --federation-config "num-supernodes=3 '
                f'{options}"`: {e["wall_seconds"]:.0f} s wall ({phases}), peak RSS of all its '
                f"processes {e['peak_rss_mb']:.0f} MB, mean accuracy {100 * e['mean_accuracy']:.1f}%.",
            ]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fedbip speed", description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--model", default="models/miniature-ldm")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--scheduler", default="pndm", choices=[s.value for s in SchedulerName])
    parser.add_argument("--sweep-steps", default="5,10,25", help="sampler-sweep: step counts")
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--concept-images", type=int, default=96)
    parser.add_argument("--classifier-images", type=int, default=1024)
    parser.add_argument("--classifier-steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "perf.json")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=ROOT / "docs" / "benchmarks" / "speed.md",
        help="the file whose speed section is rewritten",
    )
    parser.add_argument("--no-write", action="store_true", help="print, write no file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.child:
        child(args)
        return
    result = measure(args)
    command = "fedbip speed " + " ".join(argv if argv is not None else sys.argv[1:])
    command = command.strip()
    text = markdown(result, command)
    print(text)
    if not args.no_write:
        args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
        write_section(args.markdown, text, MARKER)


if __name__ == "__main__":
    main()
