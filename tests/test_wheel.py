"""The wheel is whole: built with ``pip wheel --no-deps``, installed in a fresh venv with no
repository on the path, it builds and runs both native CPU kernels, answers
``pagedjax serve --help`` and ``pagedjax bench serve --help``, and runs the GPU check's dry
run (its engine parts are ``python -m pagedjax.tools.*``, not the repository's scripts).

The fresh venv gets the project venv's site-packages through a ``.pth`` line (the
dependencies, without installing them again: a path in a ``.pth`` file is added to
``sys.path`` but its own ``.pth`` files, the editable install's finder among them, are not
run), then ``pip install --no-deps`` of the wheel. Every command runs from a temporary
directory with ``PYTHONPATH`` unset, and checks that ``pagedjax`` came from the venv.
Second tier (``-m tier2``): ~1-2 minutes, most of it the dry run's engine parts.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from pagedjax import native_build

pytestmark = [pytest.mark.tier2]

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("pyproject.toml", "README.md", "pagedjax", "pallas_kernels")

_KERNELS = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import numpy as np
    import jax, jax.numpy as jnp
    import pagedjax
    from pagedjax.attention import native_cpu, ragged_paged_attention
    from pagedjax.model import native_matmul as nm

    venv = Path(sys.argv[1]).resolve()
    assert Path(pagedjax.__file__).resolve().is_relative_to(venv), pagedjax.__file__
    for mod in (native_cpu, nm):
        ok, why = mod.available()
        assert ok, (mod.__name__, why)
        assert mod.SOURCE.is_file() and mod.SOURCE.resolve().is_relative_to(venv), mod.SOURCE
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, 32), np.float32))
    w = jnp.asarray(rng.standard_normal((2, 32, 64), np.float32))
    assert nm.uses_native(x, w, native=True)
    got = np.asarray(jax.jit(lambda a, b: nm.stacked_matmul(a, b, 1, native=True))(x, w))
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w[1]), rtol=1e-5, atol=1e-5)
    # one sequence of 6 tokens over pages 1-2 (block size 4), 2 query / 1 KV heads
    bs, hq, hkv, d = 4, 2, 1, 16
    q = jnp.asarray(rng.standard_normal((6, hq, d), np.float32))
    kp = jnp.asarray(rng.standard_normal((3, hkv, bs, d), np.float32))
    vp = jnp.asarray(rng.standard_normal((3, hkv, bs, d), np.float32))
    bt = jnp.asarray([[1, 2]], jnp.int32)
    kvl, cu = jnp.asarray([6], jnp.int32), jnp.asarray([0, 6], jnp.int32)
    args = (q, kp, vp, bt, kvl, cu)
    got = np.asarray(native_cpu.ragged_paged_attention(*args, sm_scale=0.25))
    want = np.asarray(ragged_paged_attention(*args, sm_scale=0.25))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    print("kernels ok")
    """
)


def _copy_sources(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    for name in SHIPPED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, a fresh venv with it installed)."""
    work = tmp_path_factory.mktemp("wheel")
    project = work / "project"  # a copy: no build/ or egg-info left in the repository
    project.mkdir()
    _copy_sources(project)
    pip = [sys.executable, "-m", "pip"]
    # Without build isolation when setuptools is here (seconds, no index needed).
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    argv = [*pip, "wheel", "-q", "--no-deps", *isolation, str(project), "-w", str(work / "dist")]
    res = subprocess.run(argv, capture_output=True, text=True, cwd=work)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (wheel,) = (work / "dist").glob("pagedjax-*.whl")
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (purelib,) = (venv / "lib").glob("python*/site-packages")
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (purelib / "project_deps.pth").write_text("\n".join(deps) + "\n")
    res = subprocess.run([*pip, "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--no-deps", str(wheel)], capture_output=True, text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return wheel, venv


def _run(venv: Path, argv: list[str], cwd: Path, timeout: int = 600, **env_extra: str):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = str(venv / "bin") + os.pathsep + env.get("PATH", "")
    env.update(env_extra)
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)  # fmt: skip


def test_wheel_holds_every_native_source_and_data_file(wheel_venv):
    wheel, _ = wheel_venv
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {
        str(p.relative_to(ROOT))
        for p in (ROOT / "pagedjax").rglob("*")
        if p.is_file()
        and (p.suffix in (".cc", ".h") or p.parent == ROOT / "pagedjax" / "eval" / "data")
        and "__pycache__" not in p.parts
    }
    assert {"pagedjax/model/cpu_matmul.cc", "pagedjax/attention/cpu_kernel.cc",
            "pagedjax/model/cpu_lora.cc", "pagedjax/native_pool.h"} <= wanted
    assert wanted - names == set()
    assert "pagedjax/tools/host_overhead.py" in names
    assert "pagedjax/tools/offline_throughput.py" in names


@pytest.mark.skipif(native_build.compiler() is None, reason="no C++ compiler")
def test_installed_wheel_builds_and_runs_both_native_kernels(wheel_venv, tmp_path):
    _, venv = wheel_venv
    kernels = tmp_path / "kernels"  # an empty kernel cache: both libraries are built here
    res = _run(venv, [str(venv / "bin" / "python"), "-c", _KERNELS, str(venv)], tmp_path,
               PAGEDJAX_KERNEL_CACHE=str(kernels), JAX_PLATFORMS="cpu")  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "kernels ok" in res.stdout and "using XLA" not in res.stderr
    built = sorted(p.name.split("-")[0] for p in kernels.glob("*.so"))
    assert built == ["cpu_kernel", "cpu_matmul"]


def test_installed_wheel_commands_answer_help(wheel_venv, tmp_path):
    _, venv = wheel_venv
    exe = str(venv / "bin" / "pagedjax")
    serve = _run(venv, [exe, "serve", "--help"], tmp_path, timeout=300)
    assert serve.returncode == 0, serve.stderr[-3000:]
    assert "--max-model-len" in serve.stdout
    bench = _run(venv, [exe, "bench", "serve", "--help"], tmp_path, timeout=300)
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert "--num-prompts" in bench.stdout


def test_installed_wheel_runs_the_gpu_check_dry_run(wheel_venv, tmp_path):
    """The parts that ran the repository's benchmarks/*.py (the engine roofline and the end
    to end throughput) and the environment part; the kernel parts' dry run is
    tests/triton_attention/test_gpu_check_dry_run.py (it needs torch and triton)."""
    _, venv = wheel_venv
    out = tmp_path / "report.md"
    res = _run(venv, [str(venv / "bin" / "python"), "-m", "pagedjax.gpu_check", "--dry-run",
                      "--group", "engine", "--out", str(out)],
               tmp_path, JAX_PLATFORMS="cpu")  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    for part in ("environment", "roofline", "e2e-auto"):
        assert f"| {part} | ok |" in text, text[:3000]
    assert "device time / roofline" in text and "offline_throughput_tok_s[auto]" in text
    assert "an installed package" in text
    assert not list(tmp_path.glob("docs")), "wrote into the working directory's docs/"
