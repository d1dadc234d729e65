"""The README's Python trainer and server, run as written there, each in its own process."""
import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def readme_python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)


def test_the_readme_trainer_and_server_run_as_written(tmp_path):
    trainer, server = readme_python_blocks()[:2]
    assert "tensorbucket.Publisher(" in trainer and "tensorbucket.Subscriber(" in server
    # Their own channel name: the only change, so that parallel runs do not meet.
    channel = f"tbreadme-{os.getpid()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = [sys.executable, "-c"]
    serving = subprocess.Popen(run + [server.replace('"weights"', f'"{channel}"')], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    training = subprocess.run(run + [trainer.replace('"weights"', f'"{channel}"')], env=env,
                              capture_output=True, text=True, timeout=300)
    out, err = serving.communicate(timeout=300)
    assert training.returncode == 0, training.stderr
    assert serving.returncode == 0, err
    lines = out.splitlines()
    assert [line.split()[1] for line in lines] == [str(step) for step in range(100)], out
    assert all(re.fullmatch(r"version \d+ loaded, \d+ us after its publish began", line) for line in lines), out
