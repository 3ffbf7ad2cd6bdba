"""The roofline's MFU ceiling of a workload: the simulator's plans of the engine's scheduler, each at the roofline."""
import pytest

from charioteer.bench.ceiling import mfu_ceiling, model_shape_of, roofline_hardware, roofline_makespan
from charioteer.bench.e2e import Workload, engine_args
from charioteer.bench.experiments import request_flops
from charioteer.model.loader import parse_synthetic_spec
from charioteer.sim.cost import RooflineCostModel
from charioteer.sim.specs import ClusterConfig

CONFIG = parse_synthetic_spec("llama-7b,layers=1,vocab=1000")
ROOF = {"device": "cpu", "dtype": "bfloat16", "peak_matmul_gflops": 2000.0, "memory_bandwidth_gbs": 25.0}


def _kwargs(policy: str, chunk: int, batch: int, prompt: int, decode: int) -> dict:
    return engine_args(policy, chunk, batch, Workload(prompt + decode, prompt / decode, batch), "cpu").to_kwargs()


def test_one_request_is_its_prompt_then_its_decodes_each_at_the_roofline():
    """Request-level, one request of P prompt tokens and D outputs: one whole-prompt batch, then D - 1 decode
    batches, each priced alone at max(FLOPs / peak, bytes / bandwidth) per pass."""
    p, d = 64, 5
    shape = model_shape_of(CONFIG, "bfloat16")
    cost = RooflineCostModel(shape, roofline_hardware(ROOF), ClusterConfig())
    plans = [[(p, 0, True)]] + [[(1, p + i, False)] for i in range(d - 1)]
    expected = sum(cost.batch_cost(plan)[0][0] for plan in plans)
    got = roofline_makespan(shape, ROOF, _kwargs("request-level", 16, 1, p, d), [p], [d])
    assert got == pytest.approx(expected, rel=1e-9)


def test_the_paper_balanced_point_is_under_the_ridge_so_its_ceiling_is_below_one():
    """C = 49 and 15 decodes make 64-row batches; at a ridge of 80 FLOP/byte (2-byte weights) a batch under
    80 rows waits on the weights, so the ceiling lies below 64 / 80. Narrower weights raise it; a wider
    batch cap than the workload's requests changes nothing."""
    p, d, n = 196, 60, 32
    flops = n * request_flops(CONFIG, p, d)
    kwargs = _kwargs("sarathi", 49, 16, p, d)
    ceilings = {}
    for name, (dtype, quant) in {"bf16": ("bfloat16", None), "int8": ("bfloat16", "int8")}.items():
        span = roofline_makespan(model_shape_of(CONFIG, dtype, quant), ROOF, kwargs, [p] * n, [d] * n)
        ceilings[name] = mfu_ceiling(flops, span, ROOF)
    assert 0.3 < ceilings["bf16"] < 64 / 80
    assert ceilings["bf16"] < ceilings["int8"] <= 1


def test_unknown_precisions_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        model_shape_of(CONFIG, "float16")
    with pytest.raises(ValueError, match="quantization"):
        model_shape_of(CONFIG, "float32", "gguf")
