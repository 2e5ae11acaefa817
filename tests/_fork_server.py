"""A process that has imported torch, transformers, TRL and effpass once and forks a fresh child per script
(the imports cost more than most README blocks and examples on 2 cores: ~8 CPU-s each time). Each script still
gets its own process, working directory and ``__main__`` namespace, and sees only the names it imports itself.

Used by tests/tools/test_readme.py (the README's blocks) and tests/integrations/test_hf_integration.py (the
examples) through the session fixture ``fork_server`` (tests/conftest.py); tests that use it are marked
``xdist_group("readme")`` so that one worker starts one server for all of them."""
import json
import os
import subprocess
import sys
import textwrap

# Reads one JSON request per line ({"code", "cwd", "env"}), forks, runs the code in the child as a script would
# run (a fresh __main__ namespace, stdout and stderr to files in cwd, "env" added to os.environ), answers with the
# child's exit status.
SERVER = textwrap.dedent('''
    import json, os, signal, sys, traceback
    import torch, transformers, effpass, effpass.passes, effpass.testing  # noqa: F401  (preloaded, not bound)
    try:
        import trl, transformers.trainer  # noqa: F401  (the examples' trainers)
    except ImportError:
        pass
    import gc
    gc.collect(); gc.freeze(); gc.set_threshold(*THRESHOLDS)  # as in the test workers (tests/_gc.py)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            signal.alarm(600)  # a script that hangs fails (SIGALRM ends the child) instead of hanging the test
            try:
                os.chdir(req["cwd"])
                os.environ.update(req.get("env", {}))
                for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
                    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(f, fd)
                    os.close(f)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                sys.argv = ["-c"]
                exec(compile(req["code"], req.get("name", "<README block>"), "exec"),
                     {"__name__": "__main__", "__builtins__": __builtins__})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
    os._exit(0)  # stdin closed: done (no interpreter teardown of the preloaded modules)
''')


def start() -> subprocess.Popen:
    from _gc import THRESHOLDS

    code = SERVER.replace("THRESHOLDS", repr(THRESHOLDS))  # the server imports nothing from tests/
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})


def stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_block(server: subprocess.Popen, code: str, cwd, *, env: dict | None = None, name: str | None = None) -> str:
    """Runs ``code`` in a process forked from ``server``, in ``cwd`` (with ``env`` added to its environment); fails
    unless it exits 0; returns its stdout."""
    req = {"code": code, "cwd": str(cwd), "env": env or {}}
    if name:
        req["name"] = name
    server.stdin.write(json.dumps(req) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()
    assert line, f"the fork server died (exit code {server.poll()})"
    status = json.loads(line)["status"]
    why = "timed out after 600 s" if status == -14 else f"exit status {status}"
    assert status == 0, f"{why}\n" + (cwd / "stderr.txt").read_text()[-3000:]
    return (cwd / "stdout.txt").read_text()
