"""Property tests (hypothesis, bounded examples): any shape — B=1, empty bags, D not a power of two
(nor a multiple of 4), T=1, shared tables in any order — trains like the pure-PyTorch reference."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tbe_cases import EmbOptimType, PoolingMode, assert_close, make_pair
from torchrec_triton_tbe.config import load_named


@st.composite
def layouts(draw):
    num_tables = draw(st.integers(1, 3))
    specs = [(draw(st.integers(1, 12)), draw(st.integers(1, 20))) for _ in range(num_tables)]
    num_features = draw(st.integers(1, 4))
    ftm = [draw(st.integers(0, num_tables - 1)) for _ in range(num_features)]
    B = draw(st.integers(1, 3))
    lengths = [draw(st.integers(0, 5)) for _ in range(num_features * B)]
    indices = []
    for t, L in enumerate(lengths):
        rows = specs[ftm[t // B]][0]
        indices += [draw(st.integers(0, rows - 1)) for _ in range(L)]
    return specs, ftm, B, lengths, indices


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    layout=layouts(),
    mean=st.booleans(),
    weighted=st.booleans(),
    rowwise=st.booleans(),
    threshold=st.integers(1, 5),
    chunk=st.integers(1, 4),
)
def test_any_shape_trains_like_the_reference(layout, mean, weighted, rowwise, threshold, chunk):
    specs, ftm, B, lengths, indices = layout
    cfg = load_named("interpreter").replace_backward(short_threshold=threshold, long_chunk=chunk)
    ours, ref = make_pair(
        specs, ftm, oracle="reference", kernel_config=cfg,
        pooling_mode=PoolingMode.MEAN if mean else PoolingMode.SUM,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD if rowwise else EmbOptimType.EXACT_SGD,
        learning_rate=0.3, eps=0.1,
    )
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    idx = torch.tensor(indices, dtype=torch.int64)
    psw = torch.linspace(0.5, 1.5, len(indices)) if weighted else None
    out = ours(idx, offsets, psw)
    expected = ref.output(ref.forward(idx, offsets, psw))
    assert_close(out, expected, "forward", atol=1e-5, rtol=1e-5)
    grad = torch.linspace(-1, 1, out.numel()).view(out.shape)
    out.backward(grad)
    expected.backward(grad.double())
    ref.step()
    for t, (a, b) in enumerate(zip(ours.split_embedding_weights(), ref.tables)):
        assert_close(a, b, f"table {t} after one step", atol=1e-5, rtol=1e-5)
    if rowwise:
        for t, (a, b) in enumerate(zip(ours.split_optimizer_states(), ref.momentum)):
            assert_close(a[0], b, f"table {t} state", atol=1e-6, rtol=1e-5)
