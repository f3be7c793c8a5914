"""scripts/fatbin_prune.py (carries Transformer Engine's core library to the offline GPU machine with one
architecture's device code): on a shared library nvcc builds for sm_80 and sm_90, the other architecture's
payloads are zeroed, the kept one and everything else byte for byte the same, and a keep list that
matches no entry is refused. Needs nvcc (skipped without)."""
import importlib.util
import os
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc to build a fatbinary")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
spec = importlib.util.spec_from_file_location("fatbin_prune", os.path.join(ROOT, "scripts", "fatbin_prune.py"))
fatbin_prune = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fatbin_prune)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    d = tmp_path_factory.mktemp("fatbin")
    (d / "k.cu").write_text('__global__ void k(float *x) { x[threadIdx.x] *= 2.f; }\n'
                            'extern "C" void run(float *x) { k<<<1, 32>>>(x); }\n')
    subprocess.run(["nvcc", "-shared", "-Xcompiler", "-fPIC", "-gencode", "arch=compute_80,code=sm_80",
                    "-gencode", "arch=compute_90,code=sm_90", str(d / "k.cu"), "-o", str(d / "k.so")], check=True)
    return d / "k.so"


def run(*args):
    return subprocess.run(["python3", os.path.join(ROOT, "scripts", "fatbin_prune.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_other_architectures_zeroed(library, tmp_path):
    before = library.read_bytes()
    found = list(fatbin_prune.entries(before))
    assert {sm for *_, sm in found} == {80, 90}
    out = tmp_path / "k90.so"
    r = run(library, out, "--keep", "90")
    assert r.returncode == 0, r.stderr
    after = out.read_bytes()
    assert len(after) == len(before)
    zeroed = bytearray(before)
    for off, size, kind, sm in found:
        assert kind == "elf" and size > 0
        if sm == 90:
            assert after[off: off + size] == before[off: off + size]
        else:
            assert after[off: off + size] == bytes(size) != before[off: off + size]
            zeroed[off: off + size] = bytes(size)
    assert after == bytes(zeroed)  # nothing but those payloads moved


def test_keep_nothing_refused(library, tmp_path):
    r = run(library, tmp_path / "none.so", "--keep", "75")
    assert r.returncode != 0 and "no entry for sm [75]" in r.stderr
    assert not (tmp_path / "none.so").exists()
