"""`finetune nodes [--timeout S] LAUNCHER ...`: start a multi-node launch line once every node is there.

A node started alone waits inside its launcher's rendezvous before any rank exists (torchrun's static rendezvous
600 s, c10d's 600 s, DeepSpeed's ranks 30 minutes), without a word. This helper meets the other nodes first, on
the port the launch line names (node 0 listens there, the others connect), says every 30 s what it waits for, gives
up after --timeout with one line, and then runs the launch line unchanged (exec), with the launcher's own
rendezvous timeout set to the same bound where it has one. The port is free again before the launcher starts.
"""

from __future__ import annotations

import os
import re
import selectors
import shlex
import socket
import sys
import time
from pathlib import Path

DEFAULT_TIMEOUT_S = 300.0
EVERY_S = 30.0
FIRST_S = 5.0  # the first waiting line: nodes started together meet well within it
LAUNCHERS = ("torchrun", "accelerate launch", "deepspeed")
CAUSES = ("likely causes: a typo in the address or port (every node's line must name node 0's), a firewall closing "
          "that port between the nodes, or a node whose job has not started (or failed before this point)")
USAGE = ("usage: finetune nodes [--timeout SECONDS] LAUNCHER ...   (LAUNCHER: torchrun, accelerate launch or deepspeed "
         "and its line, as in docs/multi-node.md)\n\n  --timeout SECONDS  how long a node waits for the others before it "
         f"gives up (exit 2); default {DEFAULT_TIMEOUT_S:.0f}")


class Refused(Exception):
    """A mistake in the launch line or a node that did not come: one line, exit 2."""


class Plan:
    """What a launch line says about the nodes: how many, which one this is (None: not given, c10d), where they meet."""

    def __init__(self, nnodes: int, rank: int | None, addr: str, port: int, launch: list[str]):
        self.nnodes, self.rank, self.addr, self.port, self.launch = nnodes, rank, addr, port, launch

    def where(self) -> str:
        return f"{self.addr}:{self.port}"


def _has(argv: list[str], *names: str) -> bool:
    return any(a == n or a.startswith(n + "=") for a in argv for n in names)


def _with_rendezvous_timeout(argv: list[str], head: int, key: str, timeout: float) -> list[str]:
    """The launcher's own rendezvous bound, unless the line sets its --rdzv_conf itself."""
    if _has(argv, "--rdzv_conf", "--rdzv-conf"):
        return argv
    return argv[:head] + ["--rdzv_conf", f"{key}={int(timeout)}"] + argv[head:]


def _nnodes(value: str) -> int:
    return int(str(value).split(":")[0])  # torchrun's MIN:MAX waits for MIN


def _slurm_rank() -> int | None:
    return int(os.environ["SLURM_PROCID"]) if "SLURM_PROCID" in os.environ else None


def _deepspeed_args(argv: list[str]):
    """The runner's flags this needs, with its names and defaults (deepspeed/launcher/runner.py, 0.19.8), read up to
    the training script: importing DeepSpeed to use its own parser takes 10-25 s, too long before the first line."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("-H", "--hostfile", default="/job/hostfile")
    parser.add_argument("--num_nodes", type=int, default=-1)
    parser.add_argument("--node_rank", type=int, default=-1)
    parser.add_argument("--master_addr", default="")
    parser.add_argument("--master_port", type=int, default=29500)
    parser.add_argument("--no_ssh", action="store_true")
    head = next((i for i, a in enumerate(argv) if not a.startswith("-") and a.endswith(".py")), len(argv))
    return parser.parse_known_args(argv[:head])[0]


def _hostfile(path: str) -> list[str]:
    """The host names of a DeepSpeed hostfile ("name slots=N" a line; # comments), in order."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise Refused(f"finetune nodes: deepspeed --hostfile {path}: {e.strerror}") from None
    hosts = []
    for no, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^(\S+)\s+slots=(\d+)", line)
        if not match:
            raise Refused(f"finetune nodes: {path}:{no}: {line!r} is not \"HOST slots=N\"")
        hosts.append(match.group(1))
    return hosts


def plan(argv: list[str], timeout: float) -> Plan:
    """Read a launch line with the launcher's own argument parser."""
    name = os.path.basename(argv[0]) if argv else ""
    if name == "torchrun":
        from torch.distributed.run import get_args_parser

        args = get_args_parser().parse_args(argv[1:])
        if args.rdzv_backend == "static" and not args.rdzv_endpoint:
            port = 29500 if args.master_port is None else int(args.master_port)
            addr, rank, key = args.master_addr, args.node_rank, "timeout"
        else:
            host, _, port_ = (args.rdzv_endpoint or "").rpartition(":")
            addr, port = host or args.rdzv_endpoint, int(port_ or 29400)
            static = args.rdzv_backend == "static"
            rank, key = (args.node_rank if static else _slurm_rank()), ("timeout" if static else "join_timeout")
        return Plan(_nnodes(args.nnodes), rank, addr, port, _with_rendezvous_timeout(argv, 1, key, timeout))
    if name == "accelerate" and argv[1:2] == ["launch"]:
        from accelerate.commands.launch import launch_command_parser

        args = launch_command_parser().parse_args(argv[2:])
        if args.config_file or not args.num_machines:
            raise Refused("finetune nodes: give accelerate's --num_machines, --machine_rank, --main_process_ip and "
                          "--main_process_port on the line (as docs/multi-node.md does), not in a config file")
        key = "timeout" if args.rdzv_backend == "static" else "join_timeout"
        port = 29500 if args.main_process_port is None else int(args.main_process_port)
        return Plan(int(args.num_machines), int(args.machine_rank or 0), args.main_process_ip or "127.0.0.1", port,
                    _with_rendezvous_timeout(argv, 2, key, timeout))
    if name == "deepspeed":
        args = _deepspeed_args(argv[1:])
        hosts = _hostfile(args.hostfile)
        if not args.no_ssh:
            raise Refused("finetune nodes: deepspeed without --no_ssh starts every node's ranks from node 0 over ssh, so "
                          "only one node runs this line; run it without `finetune nodes`, or with --no_ssh on every node")
        nnodes = min(len(hosts), args.num_nodes) if args.num_nodes > 0 else len(hosts)
        if nnodes < 1 or not 0 <= args.node_rank < nnodes:
            raise Refused(f"finetune nodes: deepspeed --node_rank {args.node_rank}: give this node's rank, 0 to "
                          f"{nnodes - 1} for the {nnodes} node(s) of --hostfile {args.hostfile}")
        # DeepSpeed has no rendezvous bound of its own to set: its ranks meet in torch's init_process_group.
        return Plan(nnodes, args.node_rank, args.master_addr or hosts[0], int(args.master_port), argv)
    raise Refused(f"finetune nodes: unknown launcher {argv[0]!r} (one of: {', '.join(LAUNCHERS)})")


# Each launcher's spelling of what the line says about the nodes (flag names with "-" read as "_"): (node count,
# node rank, node 0's address, its port). torchrun's c10d rendezvous names HOST:PORT in --rdzv_endpoint instead.
LINE_FLAGS = {"torchrun": ("--nnodes", "--node_rank", "--master_addr", "--master_port"),
              "accelerate": ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port"),
              "deepspeed": ("--num_nodes", "--node_rank", "--master_addr", "--master_port")}


def _value(argv: list[str], flag: str) -> str | None:
    """The last value the line gives `flag` (--flag V or --flag=V; "-" and "_" alike), up to the training script."""
    found = None
    for i, a in enumerate(argv):
        if not a.startswith("--") and a.endswith(".py"):
            break
        key, eq, value = a.partition("=")
        if key.replace("-", "_") == flag.replace("-", "_"):
            found = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return found


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None  # the launcher's own parser says what is wrong with it


def check(argv: list[str], p: Plan | None = None) -> None:
    """The line's numbers, before anything listens (and, without `p`, before the launcher's parser is imported:
    torchrun's and accelerate's import torch): a port the OS can bind, a node rank below the node count, node 0's
    address given on a multi-node line (each launcher's default, 127.0.0.1 or the hostfile's first host, names every
    node itself, so the nodes never meet). `p`: the line as its launcher read it, for what the flags leave to
    defaults."""
    name = os.path.basename(argv[0])
    count, rank_flag, addr_flag, port_flag = LINE_FLAGS[name]
    endpoint = _value(argv, "--rdzv_endpoint") if name == "torchrun" else None
    ports = [(port_flag, _value(argv, port_flag))]
    if endpoint is not None:
        ports.append(("--rdzv_endpoint", endpoint.rpartition(":")[2] if ":" in endpoint else None))
    if p is not None:
        ports.append((ports[-1][0], str(p.port)))
    for flag, text in ports:
        port = _int(text)
        if port is not None and not 1 <= port <= 65535:
            raise Refused(f"finetune nodes: {name} {flag} {port}: not a port; give one from 1 to 65535 (the same on "
                          "every node's line)")
    nnodes = p.nnodes if p is not None else _int((_value(argv, count) or "").split(":")[0])
    rank = p.rank if p is not None else _int(_value(argv, rank_flag))
    if nnodes is not None and nnodes < 1:
        raise Refused(f"finetune nodes: {name} {count} {nnodes}: give the number of nodes, 1 or more")
    if nnodes is not None and rank is not None and not 0 <= rank < nnodes:
        raise Refused(f"finetune nodes: {name} {rank_flag} {rank}: not a node of the {nnodes}; give this node's "
                      f"rank, 0 to {nnodes - 1}")
    if nnodes is None or nnodes < 2 or endpoint is not None:
        return
    if name == "torchrun" and (_value(argv, "--rdzv_backend") or "static") != "static":
        raise Refused(f"finetune nodes: torchrun --rdzv_endpoint: missing on a {nnodes}-node line; give node 0's "
                      "HOST:PORT (the same on every node's line), as docs/multi-node.md does")
    if _value(argv, addr_flag) is None and not (name == "torchrun" and "PET_MASTER_ADDR" in os.environ):
        raise Refused(f"finetune nodes: {name} {addr_flag}: missing on a {nnodes}-node line; give node 0's address "
                      "(the same on every node's line), as docs/multi-node.md does")


# ----------------------------------------------------------------------------------------------
# The meeting: node 0 listens on the port, each other node connects and says "HELLO <id>", node 0 answers "COUNT k"
# as nodes arrive and "GO" to all once every node is there; the others close first (so node 0's port is not held in
# TIME_WAIT), then node 0 closes its listener.


def _say(message: str) -> None:
    print(f"finetune: {message}", file=sys.stderr, flush=True)


def _is_local(addr: str) -> bool:
    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return False
    if ip.startswith("127.") or ip == "0.0.0.0":
        return True
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((ip, 0))
        return True
    except OSError:
        return False


def _listen(port: int) -> socket.socket | None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
    except OSError:
        s.close()
        return None
    s.listen(64)
    return s


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode())
    except OSError:
        pass  # a node gone since: its connection ends at the next read


class Clock:
    def __init__(self, timeout: float):
        self.start, self.timeout, self.next_say = time.monotonic(), timeout, FIRST_S

    def waited(self) -> float:
        return time.monotonic() - self.start

    def due(self) -> bool:
        if self.waited() >= self.next_say:
            self.next_say = (self.next_say // EVERY_S + 1) * EVERY_S
            return True
        return False

    def over(self) -> bool:
        return self.waited() >= self.timeout


def _waiting(p: Plan, me: str, here: int, detail: str, clock: Clock) -> str:
    return (f"{me}: waiting {clock.waited():.0f} s for the other nodes at {p.where()}: {here} of {p.nnodes} nodes "
            f"here{detail}; {CAUSES}; giving up after {clock.timeout:.0f} s (finetune nodes --timeout)")


def _gave_up(p: Plan, me: str, here: int, detail: str, clock: Clock) -> Refused:
    return Refused(f"{me}: gave up after {clock.waited():.0f} s waiting for the other nodes at {p.where()}: {here} of "
                   f"{p.nnodes} nodes here{detail}; {CAUSES}; more time: finetune nodes --timeout SECONDS")


def host(p: Plan, server: socket.socket, clock: Clock, me: str) -> None:
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    joined: dict[socket.socket, str] = {}  # connection -> node id ("" until its HELLO)
    buffers: dict[socket.socket, bytes] = {}

    def missing() -> str:
        ids = [i for i in joined.values() if i]
        if p.rank is not None and all(i.isdigit() for i in ids):
            lost = [str(r) for r in range(p.nnodes) if r != p.rank and str(r) not in ids]
            return f" (missing: node {', '.join(lost)})" if lost else ""
        return f" (joined: {', '.join(ids)})" if ids else ""

    def count() -> int:
        return 1 + sum(1 for i in joined.values() if i)

    def drop(conn: socket.socket) -> None:
        sel.unregister(conn)
        joined.pop(conn, None)
        buffers.pop(conn, None)
        conn.close()

    try:
        while count() < p.nnodes:
            if clock.over():
                raise _gave_up(p, me, count(), missing(), clock)
            if clock.due():
                _say(_waiting(p, me, count(), missing(), clock))
            for key, _ in sel.select(timeout=0.5):
                if key.fileobj is server:
                    conn, _ = server.accept()
                    sel.register(conn, selectors.EVENT_READ)
                    joined[conn], buffers[conn] = "", b""
                    continue
                conn = key.fileobj
                data = conn.recv(4096)
                if not data:
                    drop(conn)
                    continue
                buffers[conn] += data
                if b"\n" not in buffers[conn]:
                    continue
                line = buffers[conn].split(b"\n", 1)[0].decode(errors="replace").split()
                node = line[1] if len(line) == 2 and line[0] == "HELLO" else ""
                if p.rank is not None and node.isdigit() and (int(node) == p.rank or node in joined.values()
                                                              or int(node) >= p.nnodes):
                    problem = (f"node rank {node} is this node's too" if int(node) == p.rank else
                               f"node rank {node} came twice" if node in joined.values() else
                               f"node rank {node} is not below --nnodes {p.nnodes}")
                    _send(conn, f"ERR {problem}: give each node its own rank, 0 to {p.nnodes - 1}\n")
                    drop(conn)
                    continue
                joined[conn] = node or f"#{len(joined)}"
                for c, i in list(joined.items()):
                    if i:
                        _send(c, f"COUNT {count()}\n")
        for c in joined:
            _send(c, "GO\n")
        deadline = time.monotonic() + 10
        for c in list(joined):  # the others close first
            c.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                while c.recv(4096):
                    pass
            except OSError:
                pass
            drop(c)
    finally:
        for c in list(joined):
            drop(c)
        sel.close()
        server.close()


def join(p: Plan, node: str, clock: Clock, me: str) -> None:
    here, detail = 1, f" (this one; cannot reach node 0 at {p.where()} yet)"
    while True:
        if clock.over():
            raise _gave_up(p, me, here, detail, clock)
        if clock.due():
            _say(_waiting(p, me, here, detail, clock))
        try:
            conn = socket.create_connection((p.addr, p.port), timeout=2)
        except OSError as e:
            detail = f" (this one; cannot reach node 0 at {p.where()}: {getattr(e, 'strerror', None) or e})"
            time.sleep(1)
            continue
        with conn:
            conn.sendall(f"HELLO {node}\n".encode())
            conn.settimeout(0.5)
            buffer = b""
            while True:
                if clock.over():
                    raise _gave_up(p, me, here, detail, clock)
                if clock.due():
                    _say(_waiting(p, me, here, detail, clock))
                try:
                    data = conn.recv(4096)
                except socket.timeout:
                    continue
                except OSError:
                    data = b""
                if not data:
                    detail = f" (node 0 at {p.where()} closed the connection; trying again)"
                    break
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    word, _, rest = line.decode(errors="replace").partition(" ")
                    if word == "GO":
                        return
                    if word == "ERR":
                        raise Refused(f"{me}: {rest}")
                    if word == "COUNT":
                        here, detail = int(rest), f" (connected to node 0 at {p.where()})"
        time.sleep(1)


def meet(p: Plan, clock: Clock) -> None:
    if p.rank is not None:
        me = f"node {p.rank} of {p.nnodes}"
        if p.rank == 0:
            server = _listen(p.port)
            if server is None:
                raise Refused(f"{me}: port {p.port} on this node is in use (another job, or a node 0 started twice); "
                              f"pick a free port for every node's line")
            host(p, server, clock, me)
        else:
            join(p, str(p.rank), clock, me)
        return
    # No node rank on the line (c10d): the node at the address that gets the port hosts, the others join.
    me = f"node on {socket.gethostname()} (pid {os.getpid()})"
    server = _listen(p.port) if _is_local(p.addr) else None
    if server is not None:
        host(p, server, clock, me)
    else:
        join(p, f"{socket.gethostname()}:{os.getpid()}", clock, me)


def _flags(argv: list[str]) -> tuple[float, list[str], list[str]]:
    """finetune nodes' own flags (before the launcher): (timeout, the launch line, problems)."""
    import difflib

    argv, timeout, problems = list(argv), DEFAULT_TIMEOUT_S, []
    while argv and argv[0].startswith("-"):
        key, eq, value = argv.pop(0)[2:].partition("=")
        if key != "timeout":
            close = difflib.get_close_matches(key, ["timeout"], n=1)
            problems.append(f"--{key}: unknown key '{key}'" + (f"; did you mean '{close[0]}'?" if close else ""))
            continue
        value = value if eq else (argv.pop(0) if argv else "")
        try:
            timeout = float(value)
        except ValueError:
            problems.append(f"--timeout: expected a number of seconds, got '{value}'")
            continue
        if not timeout > 0:
            problems.append(f"--timeout: give a number of seconds above 0, got {value}")
    name = os.path.basename(argv[0]) if argv else ""
    if not argv:
        problems.append("LAUNCHER: required (torchrun, accelerate launch or deepspeed, then its line)")
    elif not (name in ("torchrun", "deepspeed") or (name == "accelerate" and argv[1:2] == ["launch"])):
        problems.append(f"unknown launcher '{' '.join(argv[:2]) if name == 'accelerate' else argv[0]}' "
                        f"(one of: {', '.join(LAUNCHERS)})")
    return timeout, argv, problems


def main(argv: list[str]) -> None:
    if argv[:1] and argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + __doc__)
        raise SystemExit(0)
    try:
        timeout, argv, problems = _flags(argv)
        if problems:
            raise Refused(f"finetune nodes: {len(problems)} configuration problem(s): " + "; ".join(problems)
                          + f" ({USAGE.split('   ')[0].removeprefix('usage: ')})")
        check(argv)  # what the line itself says, before torchrun's or accelerate's parser imports torch
        p = plan(argv, timeout)
        check(argv, p)
        if p.nnodes > 1:
            meet(p, Clock(timeout))  # the bound counts from here (reading the line imports the launcher: seconds)
    except Refused as e:
        message = str(e)
        print(message if message.startswith("finetune") else f"finetune: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    _say(f"all {p.nnodes} nodes here; starting: {shlex.join(p.launch)}" if p.nnodes > 1 else
         f"one node; starting: {shlex.join(p.launch)}")
    os.execvp(p.launch[0], p.launch)


if __name__ == "__main__":
    main(sys.argv[1:])
