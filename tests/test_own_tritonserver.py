"""`nemospec serve --fill_only`: the model repository for a tritonserver of the user's own (TensorRT-LLM's
fill_template.py step), which serves it with nothing of `nemospec serve` around it."""
import contextlib
import io
import shlex
import subprocess
import time

from nemospec import cli
from serving import launch
from serving.health import triton_ready
from serving.repository import TEMPLATES
from serving.tritonserver import assemble_backends, find_tritonserver, server_env
from serving_helpers import NEEDS_TRITON, engine_dir, generate, offline  # noqa: F401 (fixtures)

pytestmark = NEEDS_TRITON


def _fill(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["serve", *argv])
    return code, out.getvalue(), err.getvalue()


def test_fill_only_needs_a_directory_the_python_backend_can_load_from(engine_dir, tmp_path):  # noqa: F811
    code, out, err = _fill("--engine_dir", str(engine_dir), "--fill_only")
    assert code == 2 and "--fill_only: needs --model_repo_dir DIR" in err and not out, err
    # Triton 2.51's Python backend split such a path: its stubs died ("stol") and it never got ready
    code, out, err = _fill("--engine_dir", str(engine_dir), "--fill_only", "--model_repo_dir", str(tmp_path / "a b"))
    assert code == 2 and "--model_repo_dir:" in err and "whitespace" in err and not (tmp_path / "a b").exists(), err
    # `--model_repo_dir ./model_repo` from the checkout's root names the templates themselves, which
    # filling replaced model by model (then read a template it had just removed)
    before = {p: p.read_bytes() for p in TEMPLATES.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
    code, out, err = _fill("--engine_dir", str(engine_dir), "--fill_only", "--model_repo_dir",
                           str(TEMPLATES / "ensemble" / ".."))
    assert code == 2 and "--model_repo_dir:" in err and "template folder" in err and not out, err
    assert {p: p.read_bytes() for p in TEMPLATES.rglob("*") if p.is_file() and "__pycache__" not in p.parts} == before


def test_the_printed_command_asks_for_the_api_key(engine_dir, tmp_path):  # noqa: F811
    """``--api_key`` was dropped without a word: the printed tritonserver served every caller."""
    code, out, _ = _fill("--engine_dir", str(engine_dir), "--model_repo_dir", str(tmp_path / "repo"), "--fill_only",
                         "--api_key", "s3 cret")
    command = shlex.split(out.strip().splitlines()[-1])
    assert code == 0 and command[-2:] == launch.restricted_api_args("s3 cret"), out
    assert any(a.startswith("--grpc-restricted-protocol=") and a.endswith("=s3 cret") for a in command), out


def test_a_filled_repository_serves_under_a_tritonserver_of_its_own(engine_dir, tmp_path):  # noqa: F811
    """The printed command, run as it is (the wheel's binary standing for the user's, with the
    Python backend a tritonserver brings and no PYTHONPATH), serves the ensemble: greedy ids equal
    `nemospec generate`'s."""
    repo = tmp_path / "repo"
    code, out, _ = _fill("--engine_dir", str(engine_dir), "--model_repo_dir", str(repo), "--fill_only",
                         "--backend", "torch", "--max_queue", "3")
    assert code == 0, out
    assert {p.name for p in repo.iterdir()} >= {"preprocessing", "speculative", "postprocessing", "ensemble"}
    assert 'key: "max_queue" value: { string_value: "3" }' in (repo / "speculative" / "config.pbtxt").read_text()
    command = shlex.split(out.strip().splitlines()[-1])
    assert command[:3] == ["tritonserver", "--model-repository", str(repo.resolve())], out
    server = find_tritonserver()
    backends = assemble_backends(server, tmp_path / "run")
    ports = [launch.free_port() for _ in range(3)]
    command = [str(server.binary), *command[1:], "--http-port", str(ports[0]), "--grpc-port", str(ports[1]),
               "--metrics-port", str(ports[2]), "--allow-gpu-metrics", "false"]
    if backends is not None:
        command += ["--backend-directory", str(backends)]
    env = server_env(server)
    env.pop("PYTHONPATH", None)   # the repository's models find nemospec themselves
    with open(tmp_path / "tritonserver.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path,
                                   start_new_session=True)
    try:
        http = f"127.0.0.1:{ports[0]}"
        deadline = time.monotonic() + 240
        while not triton_ready(http):
            assert process.poll() is None, (tmp_path / "tritonserver.log").read_text()[-2000:]
            assert time.monotonic() < deadline, (tmp_path / "tritonserver.log").read_text()[-2000:]
            time.sleep(0.25)
        want = offline(engine_dir, "The quick brown fox", 12)
        status, got = generate(type("Server", (), {"http_url": http}), text_input="The quick brown fox", max_tokens=12,
                               exclude_input_in_output=True)
        assert status == 200, got
        assert got["output_ids"] == want["output_ids"] and got["text_output"] == want["text"]
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
