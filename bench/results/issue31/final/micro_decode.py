"""Naive mesh decode, 2 stage processes (core 0/1, 1 thread), coordinator here. Works in old and new trees."""
import asyncio, sys, time, os, statistics
sys.path.insert(0, os.getcwd())
import torch
from decoding.pipeline_local import even_split
from meshd.model.store import open_model
from meshd.pipeline.proc_mesh import ProcessMesh
try:
    from decoding.sampling import SamplingSpec as SP
    from meshd.pipeline.slot import StepsRequest
    NEW = True
except ImportError:
    from decoding.sampling import SamplingParams as SP
    NEW = False

N = int(sys.argv[1]) if len(sys.argv) > 1 else 128
R = int(sys.argv[2]) if len(sys.argv) > 2 else 4

def steps(coord, rid, ids, n):
    if NEW:
        return coord.steps(StepsRequest(rid, ids, n, SP(), []))
    return coord.steps(rid, ids, n, SP(), [])

async def main():
    torch.set_num_threads(1)
    src = open_model(None); tok = src.tokenizer
    ranges = even_split(src.config.num_layers, 2)
    async with ProcessMesh(ranges, threads=1, cores=[[0], [1]]) as mesh:
        coord = mesh.coord
        ids = tok.apply_chat([{"role": "user", "content": "Write a long story about a robot who loves gardening."}])
        async for _ in steps(coord, "warm", ids, 8): pass
        if os.environ.get("PAUSE"):
            print("PIDS", [p.pid for p in getattr(mesh, "_procs", [])] , flush=True)
        rates = []
        for r in range(R):
            t_first = None; n = 0
            async for s in steps(coord, f"r{r}", ids, N):
                if t_first is None: t_first = time.perf_counter()
                n += 1
            rates.append((n - 1) / (time.perf_counter() - t_first))
        print("NEW" if NEW else "OLD", "tok/s", [round(x, 2) for x in rates], "median", round(statistics.median(rates), 2), flush=True)

asyncio.run(main())
