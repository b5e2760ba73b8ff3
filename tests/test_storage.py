"""Durable writes: a write killed at the worst moment leaves the old file, and its debris is swept."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from fedbip_flwr.storage import atomic_write, remove_partial_writes


def test_killed_write_keeps_the_old_file_and_its_leftover_is_removed(tmp_path):
    target = tmp_path / "payloads" / "a.safetensors"
    atomic_write(target, b"accepted")
    # a real process killed (SIGKILL) after writing the new bytes, before the rename
    script = textwrap.dedent(
        f"""
        import os, signal
        from fedbip_flwr import storage
        storage.os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        storage.atomic_write({str(target)!r}, b"half-done")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()
    leftovers = list(target.parent.glob(".*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].read_bytes() == b"half-done"
    assert target.read_bytes() == b"accepted"

    keep = tmp_path / "shards" / "b.safetensors"
    atomic_write(keep, b"shard")
    assert remove_partial_writes(tmp_path) == leftovers
    assert not list(tmp_path.rglob("*.tmp"))
    assert target.read_bytes() == b"accepted" and keep.read_bytes() == b"shard"
