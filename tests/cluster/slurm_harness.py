"""A real two-node Slurm cluster on localhost, started and stopped by the test suite itself.

Why: the launcher's Slurm mode (sbatch scripts, `srun` steps per node, signal handling) can only be
trusted if it is exercised against the real Slurm, not a rendered-text stand-in. Debian 12 ships
Slurm 22.05 (`apt-get install slurm-wlm slurm-client munge`), and this recipe works on the CI machine
kind (root, no systemd as PID 1, gVisor): one munged, one slurmctld and
two slurmd processes for two *logical* nodes (`slurmd -N n1`, `-N n2`) on this host, 8 fake GPUs
per node backed by character devices.

Everything the harness writes (configs, state, spool, logs, fake GPU device nodes) lives under the
given work directory; the daemons run in the foreground (`-D`) so the harness holds their PIDs and
stops exactly those (SIGTERM, bounded wait, SIGKILL) instead of matching process names. munged is
the one shared piece (Slurm's auth plugin talks to its default socket): an already working munged
is reused and left alone; one the harness starts, it stops.
"""

from __future__ import annotations

import os
import re
import shutil
import signal as _signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

# Binaries the harness needs; a missing one means the Debian packages are not installed.
SLURM_BINARIES = ("slurmctld", "slurmd", "sinfo", "squeue", "scontrol", "sbatch", "scancel", "srun")
MUNGE_BINARIES = ("munged", "munge", "unmunge")
INSTALL_HINT = "apt-get install -y --no-install-recommends slurm-wlm slurm-client munge"

NODES: tuple[str, str] = ("n1", "n2")
# Logical CPUs per node. The CI machine may have fewer real ones: SlurmdParameters=config_overrides
# makes slurmd report the configured values instead of draining the node for "low CPU count".
# 4 leaves room for a batch step plus concurrent `srun` steps on each node.
CPUS_PER_NODE = 4
GPUS_PER_NODE = 8
REAL_MEMORY_MB = 4000

# Ports the project itself uses (demo, router, engines, rehearsals); the cluster's ports must never
# collide with them, even by accident of the kernel's ephemeral allocation.
PROJECT_PORTS = frozenset({8000, 8998, 8999, 29000, *range(30000, 30101)})

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
MUNGE_KEY = Path("/etc/munge/munge.key")
# Set in the daemons' environment (slurmstepd and its helpers inherit it from slurmd) so stop() can
# find strays of *this* cluster by PID without matching on process names.
MARKER_VAR = "V4FLASH_SLURM_HARNESS"

# Terminal job states as `scontrol show job` prints them.
FINAL_STATES = frozenset({
    "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
    "BOOT_FAIL", "DEADLINE",
})

_CMD_TIMEOUT = 30.0  # every client call is bounded; slurmctld answers in milliseconds when healthy


class SlurmHarnessError(RuntimeError):
    """The cluster could not be started (or a client call failed); the message carries log tails."""


def missing_binaries() -> list[str]:
    """Names of the Slurm/munge programs not on PATH (empty when the packages are installed).

    Why a function: the conftest fails (never skips) with INSTALL_HINT when this is non-empty, so a
    machine without the packages cannot report the cluster tests as passed.
    """
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return [b for b in (*SLURM_BINARIES, *MUNGE_BINARIES) if shutil.which(b, path=path) is None]


def _which(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin")
    if found is None:
        raise SlurmHarnessError(f"{name} not found; install the packages: {INSTALL_HINT}")
    return found


def _free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1, none of the project's.

    Why at runtime: fixed ports collide with a second checkout's test run or a leftover daemon. The
    sockets are held open until all ports are picked so the kernel does not hand out one twice.
    """
    held: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            held.append(s)
            port = s.getsockname()[1]
            if port not in PROJECT_PORTS:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"<{path}: {e}>"
    return text[-chars:] if text else "<empty>"


def _munge_works(env: Mapping[str, str] | None = None) -> bool:
    """True when a munged answers on the default socket (encode + decode round trip).

    Why a round trip and not pgrep: a munged process can exist and still be unusable (stale socket,
    wrong key); Slurm only cares that credentials encode and decode.
    """
    try:
        enc = subprocess.run([_which("munge"), "-n"], capture_output=True, timeout=10, env=env)
        if enc.returncode != 0:
            return False
        dec = subprocess.run([_which("unmunge")], input=enc.stdout, capture_output=True, timeout=10, env=env)
        return dec.returncode == 0
    except (subprocess.TimeoutExpired, OSError):
        return False


def _terminate(proc: subprocess.Popen[bytes], timeout: float) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL: the bounded stop every daemon gets."""
    if proc.poll() is not None:
        return
    try:
        proc.send_signal(_signal.SIGTERM)
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def _proc_table() -> dict[int, int]:
    """pid -> ppid for every process visible in /proc."""
    table: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat_line = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The comm field may contain spaces and parentheses: split after the last ')'.
        fields = stat_line[stat_line.rfind(")") + 2:].split()
        if len(fields) >= 2:
            table[int(entry)] = int(fields[1])
    return table


def _marked_pids(marker: str) -> set[int]:
    """PIDs whose environment carries MARKER_VAR=marker, plus all their descendants."""
    needle = f"{MARKER_VAR}={marker}".encode()
    own = {os.getpid(), os.getppid()}
    marked: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in own:
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            marked.add(int(entry))
    table = _proc_table()
    grew = True
    while grew:
        grew = False
        for pid, ppid in table.items():
            if ppid in marked and pid not in marked and pid not in own:
                marked.add(pid)
                grew = True
    return marked


@dataclass
class SlurmCluster:
    """A running two-node localhost Slurm cluster rooted at `workdir`.

    Build it with `SlurmCluster.start(workdir)`; always pair with `stop()` (the pytest fixture does).
    Clients must run with `env` added to their environment (SLURM_CONF points at this cluster's
    slurm.conf, so nothing in /etc/slurm is read or written).
    """

    workdir: Path
    conf: Path
    ports: dict[str, int]
    nodes: tuple[str, str] = NODES
    cpus_per_node: int = CPUS_PER_NODE
    gpus_per_node: int = GPUS_PER_NODE
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _logs: dict[str, Path] = field(default_factory=dict, repr=False)
    _stopped: bool = field(default=False, repr=False)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def start(cls, workdir: Path, *, ready_timeout: float = 60.0) -> SlurmCluster:
        """Write the configs, create the fake GPUs, start munged (if needed), slurmctld and two slurmd,
        and return once `sinfo` shows both nodes idle.

        Why bounded: a daemon that cannot start (port taken, auth failure, bad config) would otherwise
        hang the suite; after `ready_timeout` seconds this raises SlurmHarnessError with the tails of
        every daemon's log and stops whatever it had started.
        """
        missing = missing_binaries()
        if missing:
            raise SlurmHarnessError(f"missing {', '.join(missing)}; install the packages: {INSTALL_HINT}")
        workdir = Path(workdir).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        # slurmstepd puts unix sockets named <spool>/<node>_<job>.<step> in the spool dir; sun_path
        # holds 108 bytes, so a deep tmp dir would break every step with an obscure error.
        if len(str(workdir)) > 70:
            raise SlurmHarnessError(f"workdir path too long for slurmstepd's unix sockets: {workdir}")
        ctld_port, n1_port, n2_port = _free_ports(3)
        cluster = cls(workdir=workdir, conf=workdir / "slurm.conf",
                      ports={"slurmctld": ctld_port, "n1": n1_port, "n2": n2_port})
        try:
            cluster._write_configs()
            cluster._make_fake_gpus()
            cluster._start_munged()
            cluster._start_daemons()
            cluster._wait_idle(ready_timeout)
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def stop(self, timeout: float = 20.0) -> None:
        """Cancel leftover jobs, then stop every daemon this harness started, by PID.

        Why this order: slurmstepd processes outlive their slurmd, so jobs are cancelled (and given
        KillWait to die) while slurmd can still reap them; then slurmd, slurmctld and (if ours)
        munged get SIGTERM, a bounded wait and SIGKILL. Finally any process still carrying this
        cluster's marker in its environment (a stray slurmstepd and its tasks) is killed by PID.
        Safe to call twice.
        """
        if self._stopped:
            return
        self._stopped = True
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            try:
                self._cancel_all(timeout)
            except (SlurmHarnessError, subprocess.TimeoutExpired, OSError):
                pass  # stopping must go on even if the controller is unhealthy
        for name in [n for n in self._procs if n.startswith("slurmd")]:
            _terminate(self._procs[name], timeout)
        if "slurmctld" in self._procs:
            _terminate(self._procs["slurmctld"], timeout)
        self._kill_strays()
        if "munged" in self._procs:
            _terminate(self._procs["munged"], timeout)
        for f in self._open_files:
            f.close()
        self._open_files.clear()

    def leftovers(self) -> list[str]:
        """What this harness started that is still alive after stop(): daemons, strays (should be [])."""
        alive = [f"{name} pid {p.pid}" for name, p in self._procs.items() if p.poll() is None]
        alive += [f"marked pid {pid}" for pid in sorted(_marked_pids(self._marker))]
        return alive

    # ------------------------------------------------------------------ client API

    @property
    def env(self) -> dict[str, str]:
        """Variables to add to os.environ for Slurm clients (sbatch, srun, squeue...)."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self, extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """os.environ + `env` + `extra_env`: the environment for one client call."""
        merged = dict(os.environ)
        merged.update(self.env)
        if extra_env:
            merged.update(extra_env)
        return merged

    def run(self, args: Sequence[str], *, cwd: Path | None = None, extra_env: Mapping[str, str] | None = None,
            timeout: float = _CMD_TIMEOUT, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client against this cluster (bounded); raise with its output if it fails."""
        proc = subprocess.run(list(args), cwd=cwd, env=self.client_env(extra_env), capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise SlurmHarnessError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}"
                                    f"{proc.stdout.strip()}")
        return proc

    def sbatch(self, script_path: Path | None, cwd: Path, extra_env: Mapping[str, str] | None = None, *,
               args: Sequence[str] = ()) -> int:
        """Submit a batch job and return its id (`sbatch --parsable`).

        `script_path` may be None when `args` carries `--wrap=...`; extra sbatch options go in `args`.
        The job's working directory (and default slurm-<id>.out) is `cwd`.
        """
        cmd = [_which("sbatch"), "--parsable", *args]
        if script_path is not None:
            cmd.append(str(script_path))
        out = self.run(cmd, cwd=cwd, extra_env=extra_env).stdout.strip()
        # --parsable prints "<id>" or "<id>;<cluster>".
        m = re.fullmatch(r"(\d+)(;\S+)?", out)
        if m is None:
            raise SlurmHarnessError(f"sbatch --parsable printed {out!r}")
        return int(m.group(1))

    def show_job(self, jobid: int | str) -> dict[str, str]:
        """`scontrol show job -o <id>` as a dict.

        Why scontrol: there is no slurmdbd, so sacct has no records; scontrol keeps finished jobs for
        MinJobAge (set to 300 s in slurm.conf) after they end.
        """
        out = self.run([_which("scontrol"), "show", "job", "-o", str(jobid)]).stdout
        fields: dict[str, str] = {}
        for token in out.split():
            key, sep, value = token.partition("=")
            if sep and key not in fields:
                fields[key] = value
        if "JobState" not in fields:
            raise SlurmHarnessError(f"no JobState for job {jobid} in: {out!r}")
        return fields

    def state(self, jobid: int | str) -> str:
        """The job's JobState (PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, CANCELLED...)."""
        return self.show_job(jobid)["JobState"]

    def exit_code(self, jobid: int | str) -> str:
        """The job's ExitCode as Slurm prints it, "<exit status>:<signal>" (e.g. "0:0", "3:0")."""
        return self.show_job(jobid)["ExitCode"]

    def wait_state(self, jobid: int | str, states: Iterable[str], timeout: float) -> str:
        """Poll until the job's state is one of `states`; return it. Bounded: raises on timeout.

        Why raise even on another final state: a job that ended otherwise than expected will never
        reach the wanted state, so waiting for the full timeout would only hide the failure.
        """
        wanted = set(states)
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            last = self.state(jobid)
            if last in wanted:
                return last
            if last in FINAL_STATES:
                raise SlurmHarnessError(f"job {jobid} ended {last} (exit {self.exit_code(jobid)}), "
                                        f"wanted one of {sorted(wanted)}")
            if time.monotonic() > deadline:
                raise SlurmHarnessError(f"job {jobid} still {last} after {timeout:.0f} s, wanted one of "
                                        f"{sorted(wanted)}\n{self.diagnostics()}")
            time.sleep(0.2)

    def scancel(self, jobid: int | str, signal: str | None = None) -> None:
        """`scancel [--signal=SIG] <jobid>`; `jobid` may name a step ("12.0").

        Note (Slurm semantics): with --signal and no --batch/--full the signal goes to the job's
        steps, not to the batch shell, and the job is not cancelled.
        """
        cmd = [_which("scancel")]
        if signal is not None:
            cmd.append(f"--signal={signal}")
        cmd.append(str(jobid))
        self.run(cmd)

    def diagnostics(self) -> str:
        """Log tails of every daemon: what a failure message needs to be actionable."""
        parts = []
        for name, path in self._logs.items():
            # A daemon's stdout repeats its log file; it matters for errors before the log is opened.
            parts.append(f"--- {name} ({path}) ---\n{_tail(path, 800 if name.endswith('stdout') else 3000)}")
        for name, proc in self._procs.items():
            rc = proc.poll()
            parts.append(f"--- {name} pid {proc.pid}: {'running' if rc is None else f'exited {rc}'}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ internals

    def __post_init__(self) -> None:
        self._open_files: list[IO[bytes]] = []

    @property
    def _marker(self) -> str:
        return str(self.workdir)

    def _write_configs(self) -> None:
        w = self.workdir
        for d in ("state", "spool", "log", "run", "fakegpu"):
            (w / d).mkdir(exist_ok=True)
        for node in self.nodes:
            (w / "spool" / node).mkdir(exist_ok=True)
        host = socket.gethostname()
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.ports[node]} "
            f"CPUs={self.cpus_per_node} RealMemory={REAL_MEMORY_MB} Gres=gpu:{self.gpus_per_node} State=UNKNOWN"
            for node in self.nodes
        )
        # Timers are short so jobs start and end within a second or two: sched/builtin schedules on
        # submit, KillWait=5 bounds TERM->KILL on cancel, MinJobAge=300 keeps finished jobs visible to
        # scontrol for the whole session (there is no accounting database), ReturnToService=2 lets a
        # node that was DOWN come back as soon as its slurmd registers.
        self.conf.write_text(f"""\
# Generated by tests/cluster/slurm_harness.py for a throwaway test cluster.
ClusterName=v4ftest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ports['slurmctld']}
SlurmdPort={self.ports['n1']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
PropagateResourceLimits=NONE
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SlurmdParameters=config_overrides
ReturnToService=2
MessageTimeout=10
TCPTimeout=5
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
SlurmctldTimeout=60
BatchStartTimeout=20
CompleteWait=0
StateSaveLocation={w}/state
SlurmdSpoolDir={w}/spool/%n
SlurmctldPidFile={w}/run/slurmctld.pid
SlurmdPidFile={w}/run/slurmd-%n.pid
SlurmctldLogFile={w}/log/slurmctld.log
SlurmdLogFile={w}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{node_lines}
PartitionName=gpu Nodes=n[1-2] Default=YES State=UP OverSubscribe=FORCE:4 MaxTime=INFINITE
""")
        # slurmd looks for gres.conf next to slurm.conf.
        (w / "gres.conf").write_text(
            "AutoDetect=off\n"
            f"NodeName=n[1-2] Name=gpu File={w}/fakegpu/nvidia[0-{self.gpus_per_node - 1}]\n"
        )

    def _make_fake_gpus(self) -> None:
        """Character devices standing in for /dev/nvidiaN: gres.conf rejects plain files.

        Why 1:3 (/dev/null's numbers): nothing ever opens them for real; Slurm only stats them.
        """
        for i in range(self.gpus_per_node):
            dev = self.workdir / "fakegpu" / f"nvidia{i}"
            if dev.exists():
                if not stat.S_ISCHR(dev.stat().st_mode):
                    raise SlurmHarnessError(f"{dev} exists and is not a character device")
                continue
            os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))

    def _spawn(self, name: str, cmd: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        out_path = self.workdir / "log" / f"{name}.stdout"
        out = open(out_path, "wb")  # lives as long as the daemon; closed in stop()
        self._open_files.append(out)
        env = dict(os.environ)
        env[MARKER_VAR] = self._marker
        env["SLURM_CONF"] = str(self.conf)
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, **kwargs)  # type: ignore[call-overload]
        self._procs[name] = proc
        self._logs[f"{name} stdout"] = out_path
        return proc

    def _start_munged(self) -> None:
        """Reuse a working munged; otherwise start one in the foreground as user munge (ours to stop)."""
        if _munge_works():
            return
        if not MUNGE_KEY.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={MUNGE_KEY}"], check=True, timeout=30,
                           capture_output=True)
        shutil.chown(MUNGE_KEY, "munge", "munge")
        MUNGE_KEY.chmod(0o400)
        for d, mode in ((Path("/run/munge"), 0o755), (Path("/var/lib/munge"), 0o711), (Path("/var/log/munge"), 0o700)):
            d.mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
            d.chmod(mode)
        proc = self._spawn("munged", [_which("munged"), "--foreground"], user="munge", group="munge")
        self._logs["munged log"] = Path("/var/log/munge/munged.log")
        deadline = time.monotonic() + 20
        while not _munge_works():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SlurmHarnessError(f"munged did not come up (rc={proc.poll()}):\n{self.diagnostics()}")
            time.sleep(0.2)

    def _start_daemons(self) -> None:
        conf = str(self.conf)
        self._logs["slurmctld log"] = self.workdir / "log" / "slurmctld.log"
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", conf])
        for node in self.nodes:
            self._logs[f"slurmd {node} log"] = self.workdir / "log" / f"slurmd-{node}.log"
            # Under the reaper (see _reaper_main): slurmstepd double-forks away from slurmd, and PID 1
            # on the CI machine does not reap, so every job step would leave a zombie behind.
            self._spawn(f"slurmd-{node}", [sys.executable, __file__, "--reap", "--",
                                           _which("slurmd"), "-D", "-f", conf, "-N", node])

    def _wait_idle(self, timeout: float) -> None:
        """Bounded poll of `sinfo` until every node is idle; fail fast if a daemon exits."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise SlurmHarnessError(f"{name} exited {proc.returncode} during startup:\n{self.diagnostics()}")
            res = self.run([_which("sinfo"), "-h", "-N", "-o", "%N %t"], check=False, timeout=15)
            last = res.stdout.strip() + res.stderr.strip()
            states = dict(line.split(None, 1) for line in res.stdout.splitlines() if " " in line)
            if res.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise SlurmHarnessError(
                    f"nodes {self.nodes} not idle after {timeout:.0f} s; sinfo said: {last!r}\n{self.diagnostics()}")
            time.sleep(0.3)

    def _cancel_all(self, timeout: float) -> None:
        """scancel every job still queued/running, then wait (bounded) until none is left."""
        squeue = [_which("squeue"), "-h", "-o", "%i"]
        ids = self.run(squeue, timeout=15).stdout.split()
        if not ids:
            return
        self.run([_which("scancel"), *ids], check=False, timeout=15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run(squeue, timeout=15).stdout.split():
                return
            time.sleep(0.3)

    def _kill_strays(self) -> None:
        """SIGTERM then SIGKILL any process still carrying this cluster's marker (and its children)."""
        ours = {p.pid for p in self._procs.values() if p.poll() is None}
        for sig in (_signal.SIGTERM, _signal.SIGKILL):
            strays = _marked_pids(self._marker) - ours
            if not strays:
                return
            for pid in strays:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and (_marked_pids(self._marker) - ours):
                time.sleep(0.1)


def _reaper_main(cmd: list[str]) -> int:
    """Run `cmd` as a child subreaper: forward TERM/INT/HUP to it, reap every orphan that lands here.

    Why: slurmd starts each slurmstepd through a double fork, so the stepd is re-parented to the
    nearest subreaper or PID 1; the CI machine's PID 1 never reaps, leaving a zombie slurmstepd per job
    step. With this process as subreaper they are reaped as they exit. Exits with `cmd`'s status once
    `cmd` has exited and the remaining orphans are gone (or after 10 s more; stop() kills strays).
    """
    import ctypes

    pr_set_child_subreaper = 36
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0)
    child = os.posix_spawn(cmd[0], cmd, dict(os.environ))

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP):
        _signal.signal(sig, forward)
    rc: int | None = None
    deadline: float | None = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG if rc is not None else 0)
        except ChildProcessError:
            break
        if pid == child:
            rc = os.waitstatus_to_exitcode(status)
            deadline = time.monotonic() + 10
        if rc is not None and pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                break
            time.sleep(0.1)
    return 0 if rc is None else (rc if rc >= 0 else 128 - rc)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--reap" and sys.argv[2] == "--":
        sys.exit(_reaper_main(sys.argv[3:]))
    sys.exit(f"usage: {sys.argv[0]} --reap -- CMD...")
