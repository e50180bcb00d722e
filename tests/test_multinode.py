"""Two "nodes" on loopback, one rank each, with each launcher (torchrun --nnodes 2, accelerate launch
--num_machines 2, deepspeed --hostfile --no_ssh), each driving one training path under ZeRO-2.

With one output folder both nodes share: a 2-node job whose node-1 rank is killed (`kill -9`) after a checkpoint,
resumed with `--resume_from_checkpoint latest` on both nodes, has the per-step losses of the uninterrupted
one-process run.

With one output folder per node (no shared filesystem): each node holds only its own ranks' checkpoint files and
only node 0 holds the markers and the final model, so `latest` cannot be resumed as is; it is refused at start on
every node, each node's output saying why (before: node 1 started from step 0 and the job hung). Once every node's
checkpoint folder is copied into the other's output folder (what docs/multi-node.md tells a user to do), the same
command resumes, with the one-process run's losses.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from finetune.apps import nodes as nodes_app
from finetune.training import checkpoint
from launch import (ENGINE, LOOP, REPO, TRAIN, Launched, env, free_port, losses, matrix, node_launcher, run, run_nodes,
                    run_nodes_and_kill_rank, slurm_stubs, write_hostfile)

STEPS, SAVE = 6, 2  # 20 records, global batch 4: 5 steps per epoch, so the resumed run crosses into epoch 2
SCRIPTS = {"torchrun": TRAIN, "accelerate": LOOP, "deepspeed": ENGINE}
# Each launch line of docs/multi-node.md (the SLURM script runs torchrun with c10d on the Trainer path).
LINES = {**SCRIPTS, "slurm": TRAIN}
LATE = 40.0  # node 1 starts this long after node 0
# Two ranks sum the loss and gradients in another order than one process: a few float32 ulps at a loss of 6
# (measured up to 9.5e-7 under a Slurm launch); a resume that lost any state departs by 1e-3 or more.
TOL = 2e-6
REFUSAL = "the ranks do not see the same checkpoint in --output_dir"
# CI's cover: DeepSpeed's launcher (the engine) on the shared folder; torchrun (the Trainer) is the late node's, through
# the SLURM script; the folder per node's refusal runs in this process (test_ranks_that_see_different_checkpoints_are_
# refused); both cases on all three launchers with FINETUNE_FULL_MATRIX=1. The refusal and the merge are the shared
# core's, whatever the launcher.
SHARED_COVER = [("deepspeed", "zero3")]
# CI's cover of the late node: the SLURM script (torchrun's c10d under it); `finetune
# nodes` holds every line the same way before the launcher starts, and each line's waiting and giving up is
# test_a_node_alone_says_what_it_waits_for_and_gives_up's.
LATE_COVER = ["slurm"]


# The "Measured" table of docs/multi-node.md: each slow case below adds its row; FINETUNE_WRITE_MEASURED=1 writes the
# rows measured in this session into the page, between the markers (rows of cases not run this time stay).
DOC = REPO / "docs" / "multi-node.md"
BEGIN, END = "<!-- measured by tests/test_multinode.py (FINETUNE_WRITE_MEASURED=1) -->", "<!-- end of measured -->"
HEADER = "| launch line | path | preset | case | result |\n|---|---|---|---|---|"
MEASURED: dict[tuple[str, str, str, str], str] = {}


def measured(kind: str, config: str, case: str, result: str) -> None:
    MEASURED[(kind, Path(LINES[kind]).name, config, case)] = result


def write_measured_table(doc: Path = DOC) -> None:
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    old, _, tail = rest.partition(END)
    assert BEGIN in text and END in rest, f"{doc}: no {BEGIN} ... {END}"
    rows = {}
    for line in old.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[(cells[0].strip("`"), cells[1].strip("`"), *cells[2:4])] = cells[4]
    rows.update(MEASURED)
    order = list(LINES)
    body = "\n".join(f"| `{k}` | `{s}` | {c} | {case} | {r} |" for (k, s, c, case), r in
                      sorted(rows.items(), key=lambda kv: (kv[0][3], order.index(kv[0][0]), kv[0][2])))
    doc.write_text(f"{head}{BEGIN}\n{HEADER}\n{body}\n{END}{tail}")


@pytest.fixture(scope="module", autouse=True)
def measured_table():
    yield
    if MEASURED and os.environ.get("FINETUNE_WRITE_MEASURED") == "1":
        write_measured_table()


def test_the_measured_table_is_written_between_its_markers(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(f"# x\n{BEGIN}\n{HEADER}\n| `deepspeed` | `sft.py` | zero2 | kept `--x 1` | 1 |\n"
                    f"| `torchrun` | `train.py` | zero3 | new | old |\n{END}\nafter\n")
    monkeypatch.setattr(sys.modules[__name__], "MEASURED", {("torchrun", "train.py", "zero3", "new"): "2"})
    write_measured_table(page)
    write_measured_table(page)  # the same rows again: nothing doubled
    assert page.read_text() == (f"# x\n{BEGIN}\n{HEADER}\n| `deepspeed` | `sft.py` | zero2 | kept `--x 1` | 1 |\n"
                                f"| `torchrun` | `train.py` | zero3 | new | 2 |\n{END}\nafter\n")


def test_ranks_that_see_different_checkpoints_are_refused(tmp_path, monkeypatch):
    """The decision every rank takes from all ranks' views (gathered): the same folder, or the same error on all."""
    from test_resume import fake_checkpoint

    fake_checkpoint(tmp_path, 4, world_size=2, zero_stage=2)
    kw = dict(path="trainer", world_size=2, zero_stage=2)
    monkeypatch.setattr(checkpoint, "gather", lambda value: [value, value])
    assert checkpoint.resolve("latest", tmp_path, **kw) == tmp_path / "checkpoint-4"
    # Node 1 (its own output folder) found nothing.
    monkeypatch.setattr(checkpoint, "gather", lambda value: [value, (None, None)])
    with pytest.raises(checkpoint.ResumeError) as e:
        checkpoint.resolve("latest", tmp_path, **kw)
    assert f"the ranks do not see the same checkpoint in --output_dir {tmp_path} (rank 0: checkpoint-4; rank 1: none)" \
        in str(e.value) and "a filesystem all nodes share" in str(e.value)
    # Eight ranks on two nodes: grouped.
    monkeypatch.setattr(checkpoint, "gather", lambda value: [value] * 4 + [(None, None)] * 4)
    with pytest.raises(checkpoint.ResumeError, match=r"\(ranks 0-3: checkpoint-4; ranks 4-7: none\)"):
        checkpoint.resolve("latest", tmp_path, **kw)
    # An error on any rank (a folder named explicitly that node 1 lacks) stops every rank with it.
    monkeypatch.setattr(checkpoint, "gather", lambda value: [value, (None, "--resume_from_checkpoint X: no such folder")])
    with pytest.raises(checkpoint.ResumeError, match="^on rank 1: --resume_from_checkpoint X: no such folder"):
        checkpoint.resolve(str(tmp_path / "checkpoint-4"), tmp_path, **kw)


# ----------------------------------------------------------------------------------------------
# Slow: real 2-node launches.


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from finetune.models import tiny

    root = tmp_path_factory.mktemp("multinode")
    model = tiny.build(root / "model", style="chatml")
    data = tiny.write_jsonl(root / "data.jsonl", tiny.synthetic_records(20, seed=7))
    return root, model, data, write_hostfile(root / "hostfile")


def flags(job, out: Path, cache: Path, config: str = "zero2", batch: int = 2) -> list[str]:
    root, model, data, _ = job
    return ["--config", config, "--model_name_or_path", str(model), "--dataset", str(data), "--output_dir", str(out),
            "--dataset_cache_dir", str(cache), "--max_steps", str(STEPS), "--save_steps", str(SAVE),
            "--per_device_train_batch_size", str(batch), "--learning_rate", "2e-3", "--warmup_steps", "2",
            "--seed", "1234", "--max_seq_length", "128", "--disable_tqdm", "true", "--resume_from_checkpoint", "latest"]


@pytest.fixture(scope="module")
def reference(job):
    """script -> the one-process run's per-step losses (the same global batch of 4); also fills the data cache."""
    cache = {}

    def get(script: str) -> list[float]:
        if script not in cache:
            out = job[0] / f"one-{Path(script).stem}"
            run([sys.executable, script] + flags(job, out, job[0] / "cache", "ddp", 4), timeout=600).check()
            cache[script] = losses(out)
        return cache[script]

    return get


def nodes(job, kind: str, outs: list[Path], caches: list[Path]) -> list[list[str]]:
    port = free_port()
    return [node_launcher(kind, r, port, script=SCRIPTS[kind], hostfile=job[3]) + flags(job, outs[r], caches[r])
            for r in range(2)]


def killed_on_node_1(cmds, marker_folder: Path):
    """Both nodes started; node 1's rank killed once the first checkpoint is marked; both launchers must fail fast."""
    killed = run_nodes_and_kill_rank(cmds, marker_folder / f"checkpoint-{SAVE}" / checkpoint.MARKER, node=1,
                                     timeout=600, exit_bound=90)
    for node, k in enumerate(killed):
        assert k.returncode != 0 and not k.survivors, (node, k.returncode, k.survivors, k.output[-3000:])
    return killed


def assert_same_losses(expected: list[float], out: Path, what: str) -> float:
    got = losses(out)
    assert len(expected) == len(got) == STEPS, (expected, got)
    assert expected[-1] < expected[0] - 0.3, expected  # it trains
    diff = max(abs(a - b) for a, b in zip(expected, got))
    assert diff <= TOL, f"{what}: max |diff| {diff} vs the one-process run\n{expected}\n{got}"
    print(f"{what}: max |loss diff| vs one process {diff:.2e}")
    return diff


@pytest.mark.slow
@pytest.mark.parametrize("kind, config", matrix([(k, c) for c in ("zero2", "zero3") for k in SCRIPTS], SHARED_COVER))
def test_shared_output_folder_resumes_exactly_after_a_kill_on_node_1(kind, config, job, reference):
    expected = reference(SCRIPTS[kind])
    out, cache = job[0] / f"{kind}-{config}-shared", job[0] / "cache"  # the reference filled the cache
    port = free_port()
    cmds = [node_launcher(kind, r, port, script=SCRIPTS[kind], hostfile=job[3]) + flags(job, out, cache, config)
            for r in range(2)]
    killed = killed_on_node_1(cmds, out)
    resumed = run_nodes(cmds, timeout=600)
    for node, r in enumerate(resumed):
        assert r.returncode == 0, (node, r.output[-3000:])
    assert f"resume: from {out}/checkpoint-" in resumed[0].output, resumed[0].output[-3000:]
    exit_s = max(k.exit_seconds for k in killed)
    diff = assert_same_losses(expected, out, f"{kind}, {config}, shared folder, killed on node 1 "
                                             f"(exit after {exit_s:.1f}s) and resumed")
    measured(kind, config, f"shared folder: `kill -9` of node 1's rank after checkpoint-{SAVE}, same line again",
             f"every process gone {exit_s:.1f} s after the kill; resumed, {STEPS} losses vs one process: "
             f"max diff {diff:.1e}")


@pytest.mark.slow
@pytest.mark.full_matrix  # CI: its refusal in this process (test_ranks_that_see_different_checkpoints_are_refused)
@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_folder_per_node_refuses_latest_on_every_node_then_resumes_once_merged(kind, job, reference):
    expected = reference(SCRIPTS[kind])
    outs = [job[0] / f"{kind}-node{r}" for r in range(2)]
    cmds = nodes(job, kind, outs, [job[0] / f"{kind}-cache{r}" for r in range(2)])
    killed_on_node_1(cmds, outs[0])
    # Node 0 holds complete checkpoints (rank 0 writes the markers), node 1 none: refused on both, at start.
    start = time.time()
    refused = run_nodes(cmds, timeout=300)
    seconds = time.time() - start
    newest = checkpoint.latest(outs[0])
    assert newest is not None and checkpoint.latest(outs[1]) is None
    for node, r in enumerate(refused):
        assert r.returncode != 0, (node, r.output[-3000:])
        assert r.output.count(REFUSAL) == 1, (node, r.output[-3000:])  # each node's output says why, once
        assert f"(rank 0: {newest.name}; rank 1: none)" in r.output and "a filesystem all nodes share" in r.output
        assert "'loss'" not in r.output, r.output[-3000:]
    print(f"{kind}: refused on both nodes in {seconds:.1f}s")
    # What the refusal says to do: every node's checkpoint folder into each node's output folder.
    for a, b in ((0, 1), (1, 0)):
        shutil.copytree(outs[a] / newest.name, outs[b] / newest.name, dirs_exist_ok=True)
    resumed = run_nodes(cmds, timeout=600)
    for node, r in enumerate(resumed):
        assert r.returncode == 0, (node, r.output[-3000:])
    assert f"resume: from {newest}" in resumed[0].output
    assert_same_losses(expected, outs[0], f"{kind}, folder per node, merged and resumed")
    # The final model is written once, by rank 0, into node 0's folder.
    assert (outs[0] / "model.safetensors").is_file() and not (outs[1] / "model.safetensors").exists()
    if kind == "torchrun":
        # Re-run with `latest`: node 0 sees the finished model, node 1 does not: refused on both, not a lone node 1.
        again = run_nodes(cmds, timeout=300)
        for node, r in enumerate(again):
            assert r.returncode != 0 and r.output.count(REFUSAL) == 1, (node, r.output[-3000:])
            assert f"(rank 0: final model (global_step {STEPS}); rank 1: none)" in r.output, r.output[-3000:]


# ----------------------------------------------------------------------------------------------
# A node whose peers do not come (`finetune nodes` before each launch line): it says so within 30 s, names the
# address and port, the nodes there and expected, and the likely causes, then gives up with one line.

WAITING = re.compile(r"finetune: node .*: waiting (\d+) s for the other nodes at 127\.0\.0\.1:(\d+): 1 of 2 nodes "
                     r"here.*likely causes: a typo in the address or port.*a firewall.*has not started")
GAVE_UP = "gave up after"


def launch_line(kind: str, rank: int, port: int, root: Path, timeout: float) -> list[str]:
    hostfile = (slurm_stubs(root / "stubs") if kind == "slurm" else write_hostfile(root / "hostfile"))
    return node_launcher(kind, rank, port, script=LINES[kind], hostfile=hostfile, timeout=timeout)


@pytest.mark.slow  # starts each launcher (it imports torch) and waits out its --timeout
@pytest.mark.parametrize("kind, rank", [(k, 0) for k in LINES] + [("torchrun", 1)])
def test_a_node_alone_says_what_it_waits_for_and_gives_up(kind, rank, tmp_path):
    # The test's --timeout, above nodes_app.FIRST_S (the first waiting line); the default: nodes_app.DEFAULT_TIMEOUT_S.
    bound = 8.0
    port = free_port()
    cmd = launch_line(kind, rank, port, tmp_path, bound) + ["--output_dir", str(tmp_path / "out")]
    start = time.monotonic()
    with Launched(cmd, REPO, env()) as job:
        job.wait(30, until=lambda: WAITING.search(job.output))
        said = time.monotonic() - start
        assert WAITING.search(job.output) and said <= 30, f"no waiting line in 30 s\n{job.output[-3000:]}"
        assert job.wait(bound + 40), f"still waiting {bound + 40:.0f} s after its first line\n{job.output[-3000:]}"
        ended = time.monotonic() - start
        assert not job.finish()
    out = job.output
    line = WAITING.search(out)
    assert int(line.group(2)) == port and f"giving up after {bound:.0f} s (finetune nodes --timeout)" in out, out
    assert job.returncode == 2 and out.count(GAVE_UP) == 1, (job.returncode, out[-3000:])
    last = [x for x in out.splitlines() if x.strip()][-1]
    assert GAVE_UP in last and "1 of 2 nodes here" in last and "--timeout SECONDS" in last, last
    if rank == 0:
        assert "(missing: node 1)" in last, last
    else:
        assert "cannot reach node 0 at 127.0.0.1" in last, last
    assert not (tmp_path / "out").exists() and "'loss'" not in out  # no launcher, no rank started
    measured(kind, "-", f"node {rank} alone, `--timeout {bound:.0f}`",
             f"first waiting line after {said:.1f} s; exit 2 after {ended:.1f} s")
    print(f"{kind} node {rank} alone: waiting line after {said:.1f}s, gave up (exit 2) after {ended:.1f}s "
          f"(--timeout {bound:.0f})\n  {line.group(0)[:160]}...\n  {last[:160]}...")


def test_node_lines_are_read_with_the_launchers_own_parsers(tmp_path):
    """Where each launch line meets, which node this is, and the launcher's own rendezvous bound added."""
    hostfile = write_hostfile(tmp_path / "hostfile", 3)
    got = {kind: nodes_app.plan(node_launcher(kind, 1, 4321, 3, hostfile=hostfile)[4:], 77) for kind in SCRIPTS}
    for kind, p in got.items():
        assert (p.nnodes, p.rank, p.addr, p.port) == (3, 1, "127.0.0.1", 4321), (kind, vars(p))
    assert got["torchrun"].launch[1:3] == ["--rdzv_conf", "timeout=77"]
    assert got["accelerate"].launch[2:4] == ["--rdzv_conf", "timeout=77"]
    assert got["deepspeed"].launch == node_launcher("deepspeed", 1, 4321, 3, hostfile=hostfile)[4:]  # no such bound
    # DeepSpeed's line is read without importing DeepSpeed (slow): the same values as its own parser.
    from deepspeed.launcher.runner import fetch_hostfile, parse_args

    line = node_launcher("deepspeed", 1, 4321, 3, hostfile=hostfile)[5:] + ["--output_dir", "x", "--num_nodes", "9"]
    theirs, ours = parse_args(line), nodes_app._deepspeed_args(line)
    for key in ("hostfile", "num_nodes", "node_rank", "master_addr", "master_port", "no_ssh"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert nodes_app._hostfile(str(hostfile)) == list(fetch_hostfile(str(hostfile)))
    c10d = nodes_app.plan(["torchrun", "--nnodes", "2", "--rdzv_backend", "c10d", "--rdzv_endpoint", "h:9", "x.py"], 5)
    assert (c10d.nnodes, c10d.addr, c10d.port, c10d.launch[1:3]) == (2, "h", 9, ["--rdzv_conf", "join_timeout=5"])
    own = ["torchrun", "--rdzv_conf", "timeout=9", "--nnodes", "2", "--node_rank", "0", "x.py"]
    assert nodes_app.plan(own, 5).launch == own  # the user's own setting stays


@pytest.mark.slow
@pytest.mark.parametrize("kind", matrix(list(LINES), LATE_COVER))
def test_node_1_started_40_s_late_still_trains_with_the_one_process_losses(kind, job, reference):
    expected = reference(LINES[kind])
    out, cache = job[0] / f"{kind}-late", job[0] / "cache"
    port = free_port()
    hostfile = slurm_stubs(job[0] / "stubs") if kind == "slurm" else job[3]
    # DDP: what is tested is the launch (the ZeRO stages have the kill test above); no DeepSpeed op to build or wait for.
    cmds = [node_launcher(kind, r, port, script=LINES[kind], hostfile=hostfile) + flags(job, out, cache, "ddp")
            for r in range(2)]
    start = time.time()
    done = run_nodes(cmds, timeout=900, delays=[0.0, LATE])
    seconds = time.time() - start
    for node, r in enumerate(done):
        assert r.returncode == 0, (node, r.output[-3000:])
    line = WAITING.search(done[0].output)
    assert line, done[0].output[-3000:]
    assert "all 2 nodes here; starting" in done[0].output and "all 2 nodes here; starting" in done[1].output
    diff = assert_same_losses(expected, out, f"{kind}, node 1 started {LATE:.0f} s late (job {seconds:.0f}s)")
    measured(kind, "ddp", f"node 1 started {LATE:.0f} s after node 0",
             f"node 0's waiting line after {line.group(1)} s; trained, {STEPS} losses vs one process: max diff {diff:.1e}")


def test_the_waiting_line_comes_at_5_s_then_every_30_s(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(nodes_app.time, "monotonic", lambda: now[0])
    clock, said = nodes_app.Clock(199), []
    for tenth in range(0, 2000):
        now[0] = tenth / 10
        if clock.due():
            said.append(now[0])
    assert said == [5.0, 30.0, 60.0, 90.0, 120.0, 150.0, 180.0] and clock.over()


@pytest.mark.parametrize("argv, message", [
    ([], "LAUNCHER: required (torchrun, accelerate launch or deepspeed, then its line)"),
    (["--timeout", "soon", "torchrun"], "--timeout: expected a number of seconds, got 'soon'"),
    (["--timeout", "0", "torchrun"], "--timeout: give a number of seconds above 0, got 0"),
    (["mpirun", "-n", "2", "x.py"], "unknown launcher 'mpirun' (one of: torchrun, accelerate launch, deepspeed)"),
    (["--timout=9", "torchrun"], "--timout: unknown key 'timout'; did you mean 'timeout'?"),
])
def test_a_wrong_nodes_line_is_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        nodes_app.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "finetune nodes: 1 configuration problem(s): " + message in err, err
    assert len(err.strip().splitlines()) == 1, err
