"""The memory checkpoints' own rules, on one process: who keeps whose copy, the space check, the files (written
manifest last, verified, pruned), the staged copy. The multi-process behaviour is in
tests/distributed/test_memory_checkpoints.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from trainstack._checkpoint import memformat, memnode, memory
from trainstack.errors import ConfigError


def test_each_rank_keeps_its_copy_on_the_same_local_index_of_the_next_node():
    assert memory._peers(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert memory._peers(["a", "b", "c"]) == [1, 2, 0]
    assert memory._peers(["a", "a"]) == [None, None]  # one node: no copy on another one
    assert memory._peers(["a", "a", "b"]) == [2, 2, 0]  # an uneven node: every rank still has a peer elsewhere


def test_a_node_that_cannot_hold_two_sets_is_named_with_the_sizes():
    everyone = [{"node": "a", "bytes": 100 << 20, "free": 1 << 30, "used": 0},
                {"node": "b", "bytes": 100 << 20, "free": 300 << 20, "used": 0}]
    memory._check_space(everyone, [None, None], Path("/dev/shm/x"))  # own copies only: 200 MiB each fits
    with pytest.raises(ConfigError, match=r"need 400\.0 MiB in /dev/shm on node b .* one rank's state is 100\.0 "
                                          r"MiB\) but only 300\.0 MiB is free there\. HINT: give the job a larger"):
        memory._check_space(everyone, [1, 0], Path("/dev/shm/x"))


def test_copies_count_once_their_manifest_is_written_and_are_verified(tmp_path):
    node = memnode.Node(tmp_path, rank=0)
    path, sha = node.write(owner=1, step=6, world=4, chunks=[memoryview(b"state" * 50)] * 2)
    (copy,) = node.copies(world=4)
    assert (copy.owner, copy.step, copy.size, copy.sha256) == (1, 6, 500, sha) and copy.path == path
    with pytest.raises(OSError, match="arrived damaged"):
        node.write(owner=2, step=6, world=4, chunks=[memoryview(b"other")], sha256=sha)
    assert [c.owner for c in node.copies(world=4)] == [1]  # the damaged one left nothing
    assert node.copies(world=2) == []  # another world size: not this run's layout
    assert memnode.read_copy(copy) == (b"state" * 100, "")
    path.write_bytes(b"x" + path.read_bytes()[1:])
    assert memnode.read_copy(copy)[1] == "its checksum does not match"
    path.write_bytes(b"state")
    data, why = memnode.read_copy(copy)
    assert why == "truncated (5 of 500 bytes)" and len(data) == 500  # padded: a sender keeps the protocol aligned
    path.with_suffix(".json").unlink()
    assert node.copies(world=4) == []  # no manifest: a torn write does not count
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_pruning_keeps_the_newest_set_of_the_owners_this_rank_wrote(tmp_path):
    node = memnode.Node(tmp_path, rank=0)
    for step in (3, 6):
        for owner in (0, 2, 5):
            node.write(owner, step, 8, [memoryview(b"s")])
    node.prune([0, 2], keep_step=6)
    assert sorted((c.owner, c.step) for c in node.copies(8)) == [(0, 6), (2, 6), (5, 3), (5, 6)]


def test_a_packed_state_unpacks_to_equal_tensors_of_every_dtype():
    state = {"model": {"w": torch.randn(3, 5), "b": torch.tensor(2.5, dtype=torch.bfloat16)},
             "optimizer": {"state": {0: {"step": torch.tensor(4.0), "m": torch.zeros(0)}},
                           "param_groups": [{"lr": 0.1}]},
             "rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)}, "flags": torch.tensor([True, False]),
             "epoch": 2, "name": "x"}
    data = b"".join(bytes(c) for c in memformat.packed(state))
    back = memformat.unpacked(bytearray(data))
    assert back["epoch"] == 2 and back["name"] == "x" and back["rng"]["python"] == (3, (1, 2), None)
    for a, b in [(state["model"]["w"], back["model"]["w"]), (state["model"]["b"], back["model"]["b"]),
                 (state["flags"], back["flags"]), (state["rng"]["torch"], back["rng"]["torch"]),
                 (state["optimizer"]["state"][0]["m"], back["optimizer"]["state"][0]["m"])]:
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(ValueError, match="not a trainstack memory checkpoint"):
        memformat.unpacked(bytearray(b"PK\x03\x04" + bytes(60)))


def test_a_staged_state_is_a_copy_training_cannot_change():
    weight = torch.ones(3)
    state = {"model": {"w": weight}, "step": 4, "rng": (1, [2, 3])}
    buffers: dict = {}
    copy = memformat.staged(state, buffers)
    weight.add_(1)
    assert torch.equal(copy["model"]["w"], torch.ones(3)) and copy["step"] == 4 and copy["rng"] == (1, [2, 3])
    assert torch.equal(memformat.unstaged(copy, state)["model"]["w"], torch.ones(3))
    again = memformat.staged(state, buffers)
    assert again["model"]["w"] is buffers["/model/w"] and torch.equal(again["model"]["w"], torch.full((3,), 2.0))


def test_the_source_says_which_ranks_came_from_which_node():
    found = memory.Found({}, 40, Path("x"), ["own memory", "own memory", "a copy on node1", "a copy on node1"], [])
    assert found.source() == "memory at step 40 (ranks 2, 3 from a copy on node1)"
    found.sources = ["own memory"] * 2
    assert found.source() == "memory at step 40 (every rank from its own memory)"


def test_the_memory_root_is_the_users_own(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINSTACK_MEMORY_DIR", str(tmp_path))
    assert memory.memory_root() == tmp_path / f"trainstack-{os.getuid()}"
    monkeypatch.setenv("TRAINSTACK_NODE_NAME", "n7")
    assert memory.node_name() == "n7"


def _one_process(tmp_path, monkeypatch, run: str = "run-a") -> memory.MemoryCheckpoints:
    monkeypatch.setenv("TRAINSTACK_MEMORY_DIR", str(tmp_path / "shm"))
    monkeypatch.setenv("TRAINSTACK_NODE_NAME", "n0")
    (tmp_path / "shm").mkdir(exist_ok=True)
    return memory.MemoryCheckpoints.open(tmp_path / "run", 0, 1, 1 << 16, run=run)


def test_a_copy_that_passes_its_checksum_but_cannot_be_decoded_is_passed_over(tmp_path, monkeypatch):
    """A copy whose header is a crafted pickle (manifest size and checksum updated to match) runs no code and stops
    nothing: it is passed over like a damaged copy, named without torch's weights_only advice."""
    import hashlib
    import io
    import json

    mem = _one_process(tmp_path, monkeypatch)
    mem.save(5, {"model": {"w": torch.ones(3)}, "global_step": 5})
    mem.wait()
    (copy,) = mem.files.copies(1)
    header = io.BytesIO()
    import pickle

    pickle.dump(os.system, header)  # what an attacker with the user's own files would plant
    body = memformat._MAGIC + len(header.getvalue()).to_bytes(8, "little") + header.getvalue()
    copy.path.write_bytes(body)
    manifest = json.loads(copy.path.with_suffix(".json").read_text())
    manifest.update(size=len(body), sha256=hashlib.sha256(body).hexdigest())
    copy.path.with_suffix(".json").write_text(json.dumps(manifest))
    assert mem.restore(newer_than=-1) is None
    why = "; ".join(mem.last_passed_over)
    assert "rank 0's step 5 in its own memory: it passes its checksum but cannot be decoded (UnpicklingError)" in why
    assert "weights_only" not in why


def test_a_set_of_another_run_is_removed_at_open_and_never_restored(tmp_path, monkeypatch):
    mem = _one_process(tmp_path, monkeypatch, run="run-a")
    mem.save(5, {"model": {"w": torch.ones(3)}, "global_step": 5})
    mem.wait()
    mem.close(finished=False)
    other = _one_process(tmp_path, monkeypatch, run="run-b")  # the run folder was deleted and started again
    assert other.restore(newer_than=-1) is None and other.files.all_copies() == []
    assert other.stale_removed and "memory checkpoints of an earlier run in this path (step 5) removed" in \
        other.stale_removed[0]
    again = _one_process(tmp_path, monkeypatch, run="run-b")
    again.save(8, {"model": {"w": torch.ones(3)}, "global_step": 8})
    again.wait()
    assert again.restore(newer_than=-1).step == 8 and again.stale_removed == []


def test_a_failed_save_is_said_counted_and_its_recovery_said(tmp_path, monkeypatch):
    """A save that cannot be written (here: the node folder made read-only) is said once on rank 0 with the newest
    complete set; the next save that works says so; the rounds and failures are counted."""
    mem = _one_process(tmp_path, monkeypatch)
    said: list[str] = []
    mem.say = said.append
    mem.save(3, {"w": torch.ones(2)})
    mem.wait()
    written = mem.files.write

    def full(owner, step, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 -- as _Node.write
        if step in (6, 9):
            raise OSError(28, "No space left on device")
        return written(owner, step, *args, **kwargs)

    monkeypatch.setattr(mem.files, "write", full)
    for step in (6, 9):
        mem.save(step, {"w": torch.ones(2)})
        mem.wait()
    mem.save(12, {"w": torch.ones(2)})
    mem.wait()
    assert (mem.rounds, mem.failed_rounds, mem.newest_complete) == (4, 2, 12)
    assert len(said) == 2 and "the memory checkpoint of step 6 failed" in said[0] and \
        "the newest complete set is step 3" in said[0] and "work again at step 12" in said[1], said


def test_a_set_written_by_more_processes_is_passed_over_with_the_reason(tmp_path, monkeypatch):
    """A shrunk run (the driver continued on fewer nodes) finds its node's copies of a 2-process set: a memory set
    lays out one process's state each and does not reshard, so it is passed over, said, for the durable one."""
    import json

    mem = _one_process(tmp_path, monkeypatch, run="run-a")
    mem.save(7, {"model": {"w": torch.ones(3)}, "global_step": 7})
    mem.wait()
    (copy,) = mem.files.copies(1)
    manifest = json.loads(copy.path.with_suffix(".json").read_text())
    copy.path.with_suffix(".json").write_text(json.dumps({**manifest, "world": 2}))  # as a 2-process run left it
    assert mem.restore(newer_than=5) is None
    assert mem.last_passed_over == ["step 7: written by 2 processes, this run has 1 (a memory set does not "
                                    "reshard; the durable checkpoint does)"]
    assert mem.restore(newer_than=7) is None and mem.last_passed_over == []  # not newer than the durable one


def test_copies_an_abandoned_attempt_saved_past_the_restart_are_forgotten(tmp_path, monkeypatch):
    """A restart that starts at step 5 (an older set, or the durable checkpoint) removes this rank's copies of later
    steps: the attempt that wrote them was abandoned, and a later restore must not take (or mix in) its step 8."""
    mem = _one_process(tmp_path, monkeypatch)
    mem.save(8, {"model": {"w": torch.full((3,), 8.0)}, "global_step": 8})
    mem.wait()
    mem.close(finished=False)
    again = _one_process(tmp_path, monkeypatch)
    again.forget_after(5)
    assert again.files.copies(1) == []
    again.save(6, {"model": {"w": torch.full((3,), 6.0)}, "global_step": 6})
    again.wait()
    assert again.restore(newer_than=-1).step == 6
    again.forget_after(6)  # the step it starts at is kept
    assert [c.step for c in again.files.copies(1)] == [6]
