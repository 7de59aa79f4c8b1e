"""Model runtime vs independent implementations, and the cache / window interface.

- Qwen2 family vs transformers' own Qwen2 modules on the same weights (causal for qwen2; the causal mask
  replaced by an all-zero 4-D mask for Dream's bidirectional attention).
- LLaDA vs a plain forward written here from the public modeling_llada.py equations.
- Prefix-in-cache + window == the no-cache forward over the same visible context (full / block-causal,
  single and batched windows), row selection, in-place (dual cache) writes, commits by device index.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from lopa_fast.testing import random_model, tiny_hf_config

KINDS_HEADS = [("dream", 4, 2), ("dream", 4, 4), ("qwen2", 4, 1), ("llada", 4, 4), ("llada", 4, 2)]


def _hf_qwen2(hf_cfg, model):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(**{k: v for k, v in hf_cfg.items() if k not in ("model_type", "architectures")})
    cfg._attn_implementation = "eager"
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    missing, unexpected = ref.load_state_dict(model.state_dict(), strict=False)
    tied_ok = ("lm_head.weight",) if hf_cfg["tie_word_embeddings"] else ()
    assert not unexpected and all("rotary" in k or k in tied_ok for k in missing), (missing, unexpected)
    return ref


@pytest.mark.parametrize("kind, kv_heads, tied", [("dream", 2, False), ("dream", 4, False), ("qwen2", 1, True)])
def test_qwen2_family_matches_transformers(kind, kv_heads, tied):
    hf_cfg = tiny_hf_config(kind, num_kv_heads=kv_heads, tie_word_embeddings=tied, vocab_size=71)
    model = random_model(hf_cfg, seed=3)
    ref = _hf_qwen2(hf_cfg, model)
    ids = torch.randint(0, 71, (2, 11))
    with torch.no_grad():
        if kind == "dream":  # bidirectional: an all-zero additive 4-D mask replaces the causal one
            expected = ref(ids, attention_mask=torch.zeros(2, 1, 11, 11)).logits
        else:
            expected = ref(ids).logits
        got = model(ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert model.attention == ("full" if kind == "dream" else "causal")
    assert model.logits_shift


def _llada_plain_forward(sd: dict, cfg: dict, ids: torch.Tensor) -> torch.Tensor:
    """modeling_llada.py (LLaDALlamaBlock) equations, written out with explicit per-head loops."""
    H, nh, nkv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
    d = H // nh
    eps = cfg["rms_norm_eps"]

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [n, d]
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        f = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x[:, : d // 2], x[:, d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    p = "model.transformer."
    x = sd[p + "wte.weight"][ids[0]]
    n = x.shape[0]
    pos = torch.arange(n)
    for layer in range(cfg["n_layers"]):
        b = f"{p}blocks.{layer}."
        h = rms(x, sd[b + "attn_norm.weight"])
        q = h @ sd[b + "q_proj.weight"].T
        k = h @ sd[b + "k_proj.weight"].T
        v = h @ sd[b + "v_proj.weight"].T
        heads = []
        for hq in range(nh):
            hk = hq // (nh // nkv)
            qh = rope(q[:, hq * d : (hq + 1) * d], pos)
            kh = rope(k[:, hk * d : (hk + 1) * d], pos)
            att = torch.softmax(qh @ kh.T / math.sqrt(d), -1)  # bidirectional: no mask
            heads.append(att @ v[:, hk * d : (hk + 1) * d])
        x = x + torch.cat(heads, -1) @ sd[b + "attn_out.weight"].T
        h = rms(x, sd[b + "ff_norm.weight"])
        act = F.silu(h @ sd[b + "ff_proj.weight"].T) * (h @ sd[b + "up_proj.weight"].T)
        x = x + act @ sd[b + "ff_out.weight"].T
    x = rms(x, sd[p + "ln_f.weight"])
    return (x @ sd[p + "ff_out.weight"].T)[None]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_llada_matches_plain_forward(kv_heads):
    hf_cfg = tiny_hf_config("llada", num_kv_heads=kv_heads, vocab_size=53)
    model = random_model(hf_cfg, seed=5)
    ids = torch.randint(0, 53, (1, 9))
    with torch.no_grad():
        got = model(ids)
    expected = _llada_plain_forward(model.state_dict(), hf_cfg, ids)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    assert model.attention == "full" and not model.logits_shift
    assert model.mask_token_id == 52


def _no_cache_logits(model, seq, block_ids, mask="block_causal"):
    return model(seq[None], mask=mask, block_ids=torch.tensor(block_ids)[None])[0]


@pytest.mark.parametrize("kind, heads, kv_heads", KINDS_HEADS)
@pytest.mark.parametrize("mode", ["full", "block_causal"])
def test_cached_prefix_plus_window_equals_no_cache(kind, heads, kv_heads, mode):
    """Prefix committed to the cache, then a window over it == one no-cache forward where the prefix
    is block 0 (it never saw the window) and the window is block 1 (full) or blocks 1, 2 (block-causal)."""
    model = random_model(tiny_hf_config(kind, num_heads=heads, num_kv_heads=kv_heads), seed=7)
    P, n = 5, 6
    seq = torch.randint(0, 60, (P + n,))
    cache = model.new_cache(32)
    with torch.no_grad():
        prefix_logits = model.forward_window(seq[None, :P], cache=cache, commit=P, mask="full")
        assert cache.length == P
        win_blocks = [1] * n if mode == "full" else [1, 1, 1, 2, 2, 2]
        got = model.forward_window(
            seq[None, P:], cache=cache, mask=mode, block_ids=torch.tensor(win_blocks)[None]
        )
        expected = _no_cache_logits(model, seq, [0] * P + win_blocks)
    torch.testing.assert_close(prefix_logits[0], expected[:P], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], expected[P:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dream", "llada"])
def test_batched_ragged_windows_equal_single_windows(kind):
    """Three branches of different lengths over one shared cache == three separate single-window runs;
    rows= selects the same logits; commit_window with a device index commits that branch's K/V."""
    model = random_model(tiny_hf_config(kind), seed=11)
    P, n = 4, 7
    prompt = torch.randint(0, 60, (P,))
    lens = [7, 5, 3]
    wins = torch.randint(0, 60, (3, n))
    cache = model.new_cache(32)
    with torch.no_grad():
        model.forward_window(prompt[None], cache=cache, commit=P)
        batched = model.forward_window(wins, cache=cache, win_lens=torch.tensor(lens))
        rows = torch.tensor([0, 6, n + 1, 2 * n + 2])
        picked = model.forward_window(wins, cache=cache, win_lens=torch.tensor(lens), rows=rows)
        torch.testing.assert_close(picked, batched.reshape(3 * n, -1)[rows], atol=1e-6, rtol=1e-6)
        hidden = model.forward_window(wins, cache=cache, win_lens=torch.tensor(lens), rows=rows, output="hidden")
        assert hidden.shape == (4, model.config.hidden_size)
        singles = []
        for b, L in enumerate(lens):
            singles.append(model.forward_window(wins[b : b + 1, :L], cache=cache))
            torch.testing.assert_close(batched[b, :L], singles[-1][0], atol=1e-5, rtol=1e-5)
        model.forward_window(wins, cache=cache, win_lens=torch.tensor(lens))
        expected_k = cache.win_k[:, 1, :3].clone()
        cache.commit_window(torch.tensor(1), 3)
    assert cache.length == P + 3
    torch.testing.assert_close(cache.k[:, P : P + 3], expected_k)


def test_inplace_window_for_dual_cache():
    model = random_model(tiny_hf_config("dream"), seed=13)
    seq = torch.randint(0, 60, (12,))
    cache = model.new_cache(16)
    with torch.no_grad():
        full = model.forward_window(seq[None], cache=cache, commit=12)
        same = model.forward_window(seq[None, 4:8], cache=cache, start=4)
        torch.testing.assert_close(same[0], full[0, 4:8], atol=1e-5, rtol=1e-5)
        k_before = cache.k[:, 4:8].clone()
        changed = seq.clone()
        changed[4:8] = (changed[4:8] + 1) % 60
        model.forward_window(changed[None, 4:8], cache=cache, start=4)
    assert cache.length == 12
    assert not torch.allclose(cache.k[:, 4:8], k_before)
    with pytest.raises(ValueError, match="in-place"):
        model.forward_window(torch.zeros(1, 4, dtype=torch.long), cache=cache, start=10)


def test_forward_window_bad_input():
    model = random_model(tiny_hf_config("dream", max_position_embeddings=16), seed=0)
    cache = model.new_cache(16)
    with pytest.raises(ValueError, match="mask="):
        model.forward_window(torch.zeros(1, 3, dtype=torch.long), mask="diagonal")
    with pytest.raises(ValueError, match="block_ids"):
        model.forward_window(torch.zeros(1, 3, dtype=torch.long), mask="block_causal")
    with pytest.raises(TypeError, match="dtype"):
        model.forward_window(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.new_cache(17)
    with pytest.raises(ValueError, match="cache.max_len"):
        small = model.new_cache(4)
        model.forward_window(torch.zeros(1, 5, dtype=torch.long), cache=small)


# ---- the fast path's fused layer (merged q/k/v and gate/up as views) ---------------------------------------
def _fused_vs_plain(kind):
    from lopa_fast.testing import random_model, tiny_hf_config

    m = random_model(tiny_hf_config(kind, vocab_size=64, num_kv_heads=2), seed=3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ids = torch.randint(0, 60, (3, 7), generator=torch.Generator().manual_seed(0))
    plain = m(ids)
    Hkv, D, layers = m.config.num_kv_heads, m.config.head_dim, m.config.num_layers
    empty = torch.zeros(layers, 1, Hkv, D)
    rows = torch.arange(3 * 7)
    fused, k_win, v_win = m.forward_static(ids, torch.tensor(0), empty, empty, 0, torch.full((3,), 7), None,
                                           m.attention, rows)
    return m, before, plain, fused.view(3, 7, -1), k_win


@pytest.mark.parametrize("kind", ["dream", "llada"])
def test_fused_layer_equals_the_plain_one(kind):
    m, before, plain, fused, k_win = _fused_vs_plain(kind)
    torch.testing.assert_close(fused, plain, rtol=1.3e-6, atol=1e-5)  # merged GEMMs may reorder the sums
    assert k_win.shape == (m.config.num_layers, 3, 7, m.config.num_kv_heads, m.config.head_dim)
    # the HF-named parameters are unchanged (names, shapes, values) and are views of the merged tensors
    after = m.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    fl = m.fused_layers()[0]
    w = m.layer(0)
    assert w.q.weight.data_ptr() == fl.qkv_w.data_ptr() and w.gate.weight.data_ptr() == fl.gate_up_w.data_ptr()
    assert m.fused_layers() is m._fused  # cached while the weights stay put


def test_fused_view_built_under_inference_mode_stays_trainable():
    """Decoding runs under inference mode; the merged buffer the parameters become views of must not be an
    inference tensor, or training the model after a generate fails (it did: certainty_forcing's mid-run monitor)."""
    from lopa_fast.testing import random_model, tiny_hf_config

    m = random_model(tiny_hf_config("dream", vocab_size=64, num_kv_heads=2), seed=3)
    with torch.inference_mode():
        m.fused_layers()
    assert not m.fused_layers()[0].qkv_w.is_inference() and not m.layer(0).q.weight.is_inference()
    m.requires_grad_(True)
    m(torch.randint(0, 60, (1, 5), generator=torch.Generator().manual_seed(0))).sum().backward()
    assert m.layer(0).q.weight.grad is not None


def test_fused_view_follows_weight_edits_and_replacement(tmp_path):
    from lopa_fast.models.loading import save_checkpoint

    m, _, _, _, _ = _fused_vs_plain("dream")
    fl = m.fused_layers()[0]
    with torch.no_grad():
        m.layer(0).k.weight.add_(1.0)  # in-place edits (LoRA merge, training) reach the merged tensor
    Hq, D = m.config.num_heads, m.config.head_dim
    assert torch.equal(fl.qkv_w[Hq * D : Hq * D + m.layer(0).k.weight.shape[0]], m.layer(0).k.weight)
    m.to(torch.float64)  # replacement: the view is rebuilt on the next use
    assert m.fused_layers()[0].qkv_w.dtype == torch.float64
    save_checkpoint(m, tmp_path, {})  # views of one storage are written as separate tensors
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"].shape == \
        m.layer(0).k.weight.shape


@pytest.mark.parametrize("head_dim", [8, 128])
def test_rope_window_is_rope_tables_at_those_positions(head_dim):
    """An eager round's RoPE tables are slices of a table kept on the model (`rope_window`): the formula's values
    at those positions (within a last-bit difference of torch's vectorised and scalar cos / sin), grown by
    doubling when a window ends past it, rebuilt on another device."""
    from lopa_fast.testing import random_model, tiny_hf_config

    m = random_model(tiny_hf_config("dream", vocab_size=64, hidden_size=2 * head_dim, num_heads=2, num_kv_heads=1),
                     seed=0)
    assert m.config.head_dim == head_dim
    for start, n in [(0, 1), (0, 16), (5, 17), (250, 12), (700, 33)]:
        got = m.rope_window(start, n, "cpu")
        want = m.rope_tables(torch.arange(start, start + n))
        for g, w in zip(got, want):
            assert g.shape == (n, head_dim)
            torch.testing.assert_close(g, w, rtol=0, atol=2.5e-7)
    assert m._rope_window[0].shape[0] == 1024  # grown past 733 to the next power of two


@pytest.mark.parametrize("kind", ["dream", "llada"])
def test_dense_forward_is_bitwise_the_masked_one(kind):
    """dense=True (an eager one-slot round whose window fills its bucket) skips the torch attention's key mask under
    full attention: the same logits and window K/V bit for bit, over a prefix of 9 committed rows; a
    block-causal call's mask is the block rule alone, a device-length call keeps its mask: the same bits. With a
    host-int prefix the window's K/V go into the cache rows after it and attention reads them there (no copy of the
    prefix): the same bits again, the prefix rows untouched."""
    from lopa_fast.testing import random_model, tiny_hf_config

    m = random_model(tiny_hf_config(kind, vocab_size=64), seed=5)
    cfg = m.config
    g = torch.Generator().manual_seed(1)
    ck = torch.randn(cfg.num_layers, 20, cfg.num_kv_heads, cfg.head_dim, generator=g)
    cv = torch.randn(cfg.num_layers, 20, cfg.num_kv_heads, cfg.head_dim, generator=g)
    ids = torch.randint(0, 60, (1, 8), generator=g)
    rows = torch.arange(8)
    for mode, bids, clen in [("full", None, 9), ("block_causal", torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]), 9),
                             ("full", None, torch.tensor(9))]:
        args = (ids, 9, ck, cv, clen, torch.full((1,), 8), bids, mode, rows)
        want = m.forward_static(*args, attn_backend="torch")
        before = ck.clone(), cv.clone()
        got = m.forward_static(*args, attn_backend="torch", dense=True)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), mode
        # a host-int prefix: the window's K/V were written after it (`in_cache`), the prefix rows untouched
        assert torch.equal(ck[:, :9], before[0][:, :9]) and torch.equal(cv[:, :9], before[1][:, :9])
        if isinstance(clen, int):
            assert torch.equal(ck[:, 9:17], want[1][:, 0]) and torch.equal(cv[:, 9:17], want[2][:, 0])
