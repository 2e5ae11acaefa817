"""The README's Python examples run (each block in its own process).

A block runs in a process forked from one that has imported torch, transformers and effpass already (the
imports cost more than most blocks on 2 cores): each block still gets a fresh process, with its own working
directory, and sees only the names it imports itself."""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from _paths import ROOT  # noqa: E402  (the repository's root)
BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)
RUNNABLE = [b for b in BLOCKS if "(sketch" not in b]

# Reads one JSON request per line ({"code", "cwd"}), forks, runs the code in the child as a script would run
# (a fresh __main__ namespace, stdout and stderr to files in cwd), answers with the child's exit status.
FORK_SERVER = textwrap.dedent('''
    import json, os, signal, sys, traceback
    import torch, transformers, effpass, effpass.passes, effpass.testing  # noqa: F401  (preloaded, not bound)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            signal.alarm(600)  # a block that hangs fails (SIGALRM ends the child) instead of hanging the test
            try:
                os.chdir(req["cwd"])
                for fd, name in ((1, "stdout.txt"), (2, "stderr.txt")):
                    f = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(f, fd)
                    os.close(f)
                sys.stdout = os.fdopen(1, "w", buffering=1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                sys.argv = ["-c"]
                exec(compile(req["code"], "<README block>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
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


@pytest.fixture(scope="module")
def fork_server():
    proc = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    yield proc
    proc.stdin.close()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_readme_has_examples():
    assert len(RUNNABLE) >= 4


@pytest.mark.xdist_group("readme")
@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_readme_example_runs(block, tmp_path, fork_server):
    fork_server.stdin.write(json.dumps({"code": block, "cwd": str(tmp_path)}) + "\n")
    fork_server.stdin.flush()
    line = fork_server.stdout.readline()
    assert line, f"the fork server died (exit code {fork_server.poll()})"
    status = json.loads(line)["status"]
    why = "timed out after 600 s" if status == -14 else f"exit status {status}"
    assert status == 0, f"{why}\n" + (tmp_path / "stderr.txt").read_text()[-3000:]


def test_readme_lists_every_option_and_environment_variable():
    """The Options section's tables name every key of the options dict (read from the fields of
    effpass.config.Options) and every environment variable in effpass.config.ENV_VARS, and nothing else."""
    from effpass.config import ENV_VARS, OPTION_DOCS

    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("\n## Options\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = set(re.findall(r"^\| `([A-Za-z_]+)=?` \|", section, re.M))
    options = {r for r in rows if not r.startswith("EFFPASS_")}
    assert options - {"mode"} == set(OPTION_DOCS), f"README options table vs effpass.config.Options: {options ^ set(OPTION_DOCS)}"
    env = {r for r in rows if r.startswith("EFFPASS_")}
    assert env == set(ENV_VARS), f"README environment table vs effpass.config.ENV_VARS: {env ^ set(ENV_VARS)}"
