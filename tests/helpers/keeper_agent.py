"""A stand-in for `nebula_cli.agent start` handed to a keeper (tests/agent/test_keeper.py, and on
the test bed's Slurm tests/scheduler/test_slurm_batch_shapes.py): `python -c DAEMON SECONDS
MARK` forks a detached child that lives `SECONDS`, prints ``{"agent_pid": ..., "keeper_pid":
...}`` as the agent does (the keeper tracks that pid; `keeper_pid` is the process that ran it),
and returns at once; on SIGTERM the child writes "term" to MARK and exits."""

DAEMON = """
import json, os, sys, time, signal
r, w = os.pipe()
if os.fork():
    os.close(w)
    print(json.dumps({"agent_pid": int(os.read(r, 32)), "keeper_pid": os.getppid()}))
    sys.exit(0)
os.setsid()
if os.fork():
    os._exit(0)
os.write(w, str(os.getpid()).encode())
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):  # as the agent's daemon does: the caller's pipes are not held open
    os.dup2(null, fd)
signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[2], "w").write("term"), os._exit(0)))
for _ in range(int(float(sys.argv[1]) * 10)):
    time.sleep(0.1)
"""
