"""Engine.stream over a 2-process mesh (DrainingEngine → PipelineEngine → coordinator), old and new trees."""
import asyncio, sys, time, os, statistics
sys.path.insert(0, os.getcwd())
import torch
from decoding.pipeline_local import even_split
from meshd.model.store import open_model
from meshd.pipeline.proc_mesh import ProcessMesh
from meshd.pipeline.engine import PipelineEngine
from meshd.engine.base import GenerationRequest
try:
    from meshd.engine.draining import DrainingEngine
    NEW = True
except ImportError:
    from meshd.daemon import DrainingEngine
    NEW = False

N = int(sys.argv[1]) if len(sys.argv) > 1 else 96
R = int(sys.argv[2]) if len(sys.argv) > 2 else 5

async def main():
    torch.set_num_threads(1)
    src = open_model(None); tok = src.tokenizer
    ranges = even_split(src.config.num_layers, 2)
    async with ProcessMesh(ranges, threads=1, cores=[[0], [1]]) as mesh:
        engine = DrainingEngine(PipelineEngine(src, mesh.coord))
        ids = tok.apply_chat([{"role": "user", "content": "Write a long story about a robot who loves gardening."}])
        async def one(rid, n):
            t_first = None; k = 0
            async for ev in engine.stream(GenerationRequest(rid, ids, max_tokens=n)):
                if ev.token_id is None: continue
                if t_first is None: t_first = time.perf_counter()
                k += 1
            return k, time.perf_counter() - t_first
        await one("warm", 8)
        rates = []
        for r in range(R):
            k, dt = await one(f"r{r}", N)
            rates.append((k - 1) / dt)
        print("NEW" if NEW else "OLD", "engine tok/s", [round(x, 2) for x in rates], "median", round(statistics.median(rates), 2), "tokens", k, flush=True)

asyncio.run(main())
