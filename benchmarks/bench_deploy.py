"""The deploy example's model (examples/deploy/export_model.py) as an AOTInductor package
against eager Python, on the CPU (issue 22).

    PYTHONPATH=python .venv/bin/python benchmarks/bench_deploy.py [--shape 4,512] [--reps 20]

Compiles one package with dynamic batch and sequence (as the example does), then times,
interleaved in one process: eager (the nn.Module), the package run from Python. Prints the
median and min of each and their ratio, and the ops around posenc's calls in the exported
graph (no copy should sit between them and their producers).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "deploy"))
from export_model import MAX_LEN, TinyLM, make_inputs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="4,512", help="batch,seq of the timed input")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    batch, seq = (int(v) for v in args.shape.split(","))
    torch.manual_seed(0)
    model = TinyLM().eval()
    inputs = make_inputs(batch, seq, seed=0)
    dims = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=MAX_LEN // 2)
    program = torch.export.export(model, make_inputs(2, 24, seed=1),
                                  dynamic_shapes=({0: dims[0], 1: dims[1]}, {0: dims[0], 1: dims[1]}))
    copies = [n for n in program.graph.nodes if n.op == "call_function"
              and n.target in (torch.ops.aten.clone.default, torch.ops.aten.contiguous.default,
                               torch.ops.aten._to_copy.default)]
    print(f"exported graph: {len(copies)} copy node(s) (clone/contiguous/_to_copy): "
          f"{[str(n.target) for n in copies]}")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = torch._inductor.aoti_compile_and_package(program, package_path=os.path.join(tmp, "m.pt2"))
        print(f"AOTInductor compile: {time.perf_counter() - start:.0f} s")
        package = torch._inductor.aoti_load_package(path)
        times = {"eager": [], "aoti": []}
        with torch.no_grad():
            want = model(*inputs)
            err = (package(*inputs) - want).abs().max().item()
            for _ in range(3):
                model(*inputs), package(*inputs)
            for _ in range(args.reps):
                for name, fn in (("eager", model), ("aoti", package)):
                    t0 = time.perf_counter()
                    fn(*inputs)
                    times[name].append(time.perf_counter() - t0)
    print(f"shape ({batch}, {seq}), {torch.get_num_threads()} threads, {args.reps} interleaved reps; "
          f"max |aoti - eager| = {err:.3g}")
    for name, ts in times.items():
        print(f"  {name:6s} median {statistics.median(ts) * 1e3:8.2f} ms   min {min(ts) * 1e3:8.2f} ms")
    ratio = statistics.median(times["eager"]) / statistics.median(times["aoti"])
    print(f"  eager / aoti (medians): {ratio:.2f}x")


if __name__ == "__main__":
    main()
