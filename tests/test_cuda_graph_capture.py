"""The CUDA ops (lopa_fast.ops.cuda) together inside torch.compile(fullgraph=True) and a captured CUDA graph
(`gpu`: skipped without a device)."""
from __future__ import annotations

import pytest
import torch

from tests.utils import cuda_kernels, make_attention_inputs  # noqa: F401 - cuda_kernels: a fixture

pytestmark = pytest.mark.gpu


def test_compile_and_cuda_graph_capture(cuda_kernels):
    """The custom ops run inside torch.compile(fullgraph=True) and inside a captured CUDA graph."""
    q, kc, vc, L, kw, vw, wl, bid = make_attention_inputs((3, 32, 28, 4, 128, 300), torch.bfloat16, device="cuda", extra_rows=5, len_step=3)
    logits = torch.randn(96, 4096, device="cuda", dtype=torch.bfloat16)

    def step(q, logits):
        o = cuda_kernels.branch_attention(q, kc, vc, L, kw, vw, wl, bid, "block_causal")
        return o, cuda_kernels.confidence(logits, None, 1e-10)[0]

    want_o, want_t = step(q, logits)
    got_o, got_t = torch.compile(step, fullgraph=True)(q, logits)
    assert torch.equal(got_o, want_o) and torch.equal(got_t, want_t)

    static_q, static_l = q.clone(), logits.clone()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):  # warm-up off the default stream, as torch's graph docs ask
        step(static_q, static_l)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_o, out_t = step(static_q, static_l)
    static_q.copy_(q * 0.5)
    static_l.copy_(-logits)
    graph.replay()
    torch.cuda.synchronize()
    ref_o, ref_t = step(q * 0.5, -logits)
    assert torch.equal(out_o, ref_o) and torch.equal(out_t, ref_t)
