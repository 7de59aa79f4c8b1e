"""Compile every Triton kernel for sm_90 without a GPU and tabulate registers, shared memory and spills.

    python bench/compile_triton.py            # all variants, writes bench/results/kernel_resources.md
    python bench/compile_triton.py --quick    # one variant per kernel, no file (the CI check)

Uses triton.compile with GPUTarget("cuda", 90, 32) (no driver needed) and Triton's bundled ptxas
(`-arch=sm_90a -v`) on the emitted PTX, because `n_regs` needs a driver (docs/toolchain.md section 4). Exits 1 on any
compile error or any spill. Shapes are Dream-7B's (Hq 28, Hkv 4, D 128, V 152064) with the launchers'
own tile choices, so the table describes what runs on the H200.
Must run with TRITON_INTERPRET unset (under the interpreter @triton.jit yields no compilable function).
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("compile_triton.py: unset TRITON_INTERPRET (the interpreter cannot compile for sm_90)")

import torch  # noqa: E402
import triton  # noqa: E402
from tabulate import tabulate  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from lopa_fast.reference.attention_modes import ATTENTION_MODES, MODE_CODES  # noqa: E402
from lopa_fast.kernels.triton import branch_attention as ba  # noqa: E402
from lopa_fast.kernels.triton import commit_round as cmr  # noqa: E402
from lopa_fast.kernels.triton import confidence as cf  # noqa: E402
from lopa_fast.kernels.triton import first_bad as fb  # noqa: E402
from lopa_fast.kernels.triton import head_confidence as hc  # noqa: E402
from lopa_fast.kernels.triton import norm_linear as nl  # noqa: E402
from lopa_fast.kernels.triton import select_round as sr  # noqa: E402
from lopa_fast.kernels.triton import select_step as ss  # noqa: E402
from lopa_fast.kernels.triton import window_inputs as wi  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _signature(fn, types: dict, constexprs: dict):
    """Full signature in argument order: pointers '*dt', ints 'i32', floats 'fp32', constexprs."""
    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else types[name]
    return sig


def _attrs(fn, sig, aligned: set):
    # pointers and the strides/sizes named in `aligned` are 16-divisible at Dream-7B shapes, as Triton's
    # launcher would specialise them at run time (vectorised 16-byte loads)
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name].startswith("*") or name in aligned}


def variants(quick: bool):
    """(label, jit fn, types, constexprs, aligned ints, options)."""
    G, D = 7, 128
    out = []
    dtypes = ["bf16"] if quick else ["bf16", "fp16", "fp32"]
    for dt in dtypes:
        prec = "ieee" if dt == "fp32" else "tf32"
        BM, BN, warps = ba.block_sizes({"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt])
        aligned = {"s_qb", "s_qn", "s_qh", "s_ks", "s_kl", "s_kh", "s_vs", "s_vl", "s_vh", "chunk"}
        # CL_PTR: the prefix length read from device memory (the captured / compiled round) or an int;
        # POOLED: rows of one branch per tile on its slot of a [S, Lmax, Hkv, D] pool (cache_index / [S] lengths)
        for cl_ptr, pooled in ((True, False), (False, False), (True, True)):
            types = {n: "i32" for n in ba._prefix_kernel.arg_names}
            types.update(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", o_ptr="*fp32", lse_ptr="*fp32",
                         ci_ptr="*i64" if pooled else "*fp32", qk_scale="fp32",
                         cache_len="*i64" if cl_ptr else "i32")
            ce = dict(G=G, D=D, BLOCK_D=D, BLOCK_M=BM, BLOCK_N=BN, UPCAST=False, DOT_PREC=prec, CL_PTR=cl_ptr,
                      POOLED=pooled)
            name = f"_prefix_kernel {dt}" + (" pooled" if pooled else " device cache_len" if cl_ptr else "")
            out.append((name, ba._prefix_kernel, types, ce, aligned, dict(num_warps=warps, num_stages=2)))
        modes = ["block_causal"]
        if dt == "bf16" and not quick:
            modes = list(ATTENTION_MODES)
        for mode in modes:
            m = MODE_CODES[mode]
            for has_wl, ret_lse in ((True, True), (False, False)) if mode == "full" else ((True, True),):
                _window_variant(out, dt, mode, m, has_wl, ret_lse, G, D, BM, BN, warps, prec)
        for prefix_in in ("device", "pooled") if dt != "fp32" else ():  # the one-launch path (one split; not fp32:
            # `branch_attention.one_launch`)
            _window_variant(out, dt, "block_causal", MODE_CODES["block_causal"], True, True, G, D, BM, BN, warps,
                            prec, prefix_in)
        if quick:
            break
    _confidence_variants(out, dtypes)
    _head_confidence_variants(out, dtypes)
    _norm_linear_variants(out, dtypes)
    _round_glue_variants(out, dtypes)
    _select_round_variants(out, quick)
    _select_step_variants(out, quick)
    _window_inputs_variants(out, quick)
    return out


def _window_inputs_variants(out, quick: bool):
    """The round's forward inputs at Dream LoPA shapes: NB 9, Lb + 1 = 513, a 256-column window (the [9, 256] tile
    and its 4,096-entry prefix counts); D2F (NB 1) in the full run."""
    i64, u8 = "*i64", "*u8"
    types = dict(x=i64, need_all=u8, alive=u8, window_lens=i64, running=u8, lens=i64, layout_slot=i64, counts=i64,
                 start=i64, total_len=i64, pos_block=i64, o_pos=i64, o_valid=u8, o_tokens=i64, o_block=i64,
                 o_wl=i64, o_need=u8, o_rows=i64, o_counts=i64)
    for NB in (9,) if quick else (9, 1):
        ce = dict(NB=NB, L1=513, Nb=256, Rb=min(NB * 256, 512), BLOCKS=True, BNB=triton.next_power_of_2(max(NB, 2)),
                  BN=256)
        out.append((f"_window_inputs_kernel NB={NB} Nb=256", wi._window_inputs_kernel, types, ce, set(),
                    dict(num_warps=wi.NUM_WARPS)))


def _select_step_variants(out, quick: bool):
    """The threshold step op at Dream / LLaDA shapes: a 32-row block (BN 32) on a 1,024-position canvas; every rule
    in the full run (factor's [32, 32] rank is the largest tile), float32 (Dream) and float64 (LLaDA) confidences."""
    fn = ss._select_step_kernel
    i64, u8, f64 = "*i64", "*u8", "*fp64"
    for rule in (2,) if quick else (0, 1, 2, 3):
        for conf in ("*fp32",) if quick else ("*fp32", "*fp64"):
            types = dict(x=i64, pos=i64, valid=u8, x0=i64, conf=conf, ent=f64, finite=u8, multi=i64, noop=i64,
                         s=i64, knob=f64, o_x=i64, o_fm=i64, o_multi=i64, o_noop=i64, o_head=i64, L="i32", n="i32")
            ce = dict(RULE=rule, mask_id=151666, B=32, BB=32, BN=32, BLK=1024)
            out.append((f"_select_step_kernel rule={rule} conf={conf[1:]}", fn, types, ce, set(),
                        dict(num_warps=ss.NUM_WARPS, enable_fp_fusion=False)))


def _select_round_variants(out, quick: bool):
    """The fused round op at Dream LoPA shapes: k = 8 (NB 9), gen 256 in blocks of 32 (G 8), prompt 256
    (Lb + 1 = 513), a 256-column window; D2F (NB 1) in the full run."""
    fn = sr._select_round_kernel
    f32, i64, u8, f64 = "*fp32", "*i64", "*u8", "*fp64"
    types = dict(conf=f32, token=i64, p=f32, x=i64, n_blocks=i64, block_state=i64, complete=u8, eos=u8, alive=u8,
                 creation_conf=f64, look_pos=i64, counts=i64, exists=u8, active=u8, running=u8, is_mask=u8,
                 lens=i64, to_cache=u8, shared_end=i64, layout_slot=i64, commit_len=i64, win_pos=i64,
                 win_valid=u8, need_flat=u8, prompt_len=i64, gen_pos=i64, block_start=i64, block_end=i64,
                 pos_block=i64, in_block=u8, lowest_k=i64, grow_table=u8, activate_table=u8, skip_threshold=f64,
                 alpha=f64, o_winner=i64, o_score=f64, o_last_row=i64, o_accepted=u8, o_tokens=i64, o_x=i64,
                 o_eos=u8, o_alive=u8, o_cconf=f64, o_look=i64, o_state=i64, o_counts=i64, p_nblk=i64,
                 p_complete=u8, p_exists=u8, p_active=u8, p_running=u8, p_done=u8, p_ismask=u8, p_need=u8,
                 p_lens=i64, p_wl=i64, p_tc=u8, p_spe=i64, p_lay=i64, p_start=i64, p_commit=i64, p_head=i64)
    for NB, n_look in ((9, 8),) if quick else ((9, 8), (1, 0)):
        ce = dict(NB=NB, L1=513, G1=9, Nb=256, bs=32, mask_id=151666, eos_id=151643, n_look=n_look, SHIFT=True,
                  BLEND=NB > 1, SCORE=False, BNB=triton.next_power_of_2(max(NB, 2)), BN=256, BG=16, BL=1024)
        out.append((f"_select_round_kernel NB={NB} Nb=256", fn, types, ce, set(),
                    dict(num_warps=sr.NUM_WARPS, enable_fp_fusion=False)))


def _window_variant(out, dt, mode, m, has_wl, ret_lse, G, D, BM, BN, warps, prec, prefix_in=None):
    """prefix_in: None (the split path: the prefix kernel's partials merged), "device" (one launch reading the prefix
    at a device length: the captured round) or "pooled" (one launch over a pool slot per branch)."""
    types = {n: "i32" for n in ba._window_kernel.arg_names}
    types.update(q_ptr=f"*{dt}", k_ptr=f"*{dt}", v_ptr=f"*{dt}", o_ptr=f"*{dt}", lse_ptr="*fp32", po_ptr="*fp32",
                 plse_ptr="*fp32", wl_ptr="*i64", blk_ptr="*i64", qk_scale="fp32", kc_ptr=f"*{dt}", vc_ptr=f"*{dt}",
                 ci_ptr="*i64" if prefix_in == "pooled" else "*fp32", cache_len="*i64" if prefix_in else "i32")
    ce = dict(G=G, D=D, BLOCK_D=D, MODE=m, HAS_WL=has_wl, RETURN_LSE=ret_lse, BLOCK_M=BM, BLOCK_N=BN,
              UPCAST=False, DOT_PREC=prec, PREFIX_IN=prefix_in is not None, CL_PTR=prefix_in is not None,
              POOLED=prefix_in == "pooled")
    aligned = {"s_qb", "s_qn", "s_qh", "s_kb", "s_kn", "s_kh", "s_vb", "s_vn", "s_vh", "s_ob", "s_on", "s_oh",
               "s_ks", "s_kl", "s_kh_c", "s_vs", "s_vl", "s_vh_c"}
    extra = ("" if has_wl else " no-win_lens no-lse") + (f" prefix in ({prefix_in})" if prefix_in else "")
    out.append((f"_window_kernel {dt} {mode}{extra}", ba._window_kernel, types, ce, aligned,
                dict(num_warps=warps, num_stages=2)))


def _confidence_variants(out, dtypes):
    for dt in dtypes:
        types = {n: "i32" for n in cf._confidence_kernel.arg_names}
        types.update(x_ptr=f"*{dt}", tok_ptr="*i64", pmax_ptr="*fp32", margin_ptr="*fp32", negent_ptr="*fp32",
                     lse_ptr="*fp32", eps="fp32")
        ce = dict(HAS_SUPPRESS=True, BLOCK_V=cf.block_v_for(152064))
        for sup in (True, False) if dt == "bf16" and len(dtypes) > 1 else (True,):
            out.append((f"_confidence_kernel {dt} V=152064{'' if sup else ' no-suppress'}", cf._confidence_kernel,
                        types, dict(ce, HAS_SUPPRESS=sup), {"stride_x"}, dict(num_warps=8, num_stages=3)))
        types = {n: "i32" for n in cf._conf_partial_kernel.arg_names}
        types.update(x_ptr=f"*{dt}", pm1_ptr="*fp32", pi1_ptr="*i32", pm2_ptr="*fp32", ps_ptr="*fp32")
        out.append((f"_conf_partial_kernel {dt} V=152064", cf._conf_partial_kernel, types, ce, {"stride_x"},
                    dict(num_warps=8, num_stages=3)))
        types = {n: "i32" for n in cf._conf_entropy_kernel.arg_names}
        types.update(x_ptr=f"*{dt}", pm1_ptr="*fp32", pi1_ptr="*i32", pm2_ptr="*fp32", ps_ptr="*fp32",
                     pent_ptr="*fp32", eps="fp32")
        out.append((f"_conf_entropy_kernel {dt} V=152064", cf._conf_entropy_kernel, types, dict(ce, BLOCK_S=16),
                    {"stride_x"}, dict(num_warps=8, num_stages=3)))
    types = {n: "*fp32" for n in cf._conf_finalize_kernel.arg_names}
    types.update(pi1_ptr="*i32", tok_ptr="*i64", S="i32")
    out.append(("_conf_finalize_kernel S<=16", cf._conf_finalize_kernel, types, dict(BLOCK_S=16), set(),
                dict(num_warps=1, num_stages=3)))


def _norm_linear_variants(out, dtypes):
    """The layer's fused GEMMs at a LoPA round's rows (161: 64-row tiles) with the add + norm prologue: Dream-7B's
    gate/up + SwiGLU (K = 3,584, F = 18,944) and q/k/v + bias + RoPE (N = 4,608, D = 128); Qwen2.5-0.5B's q/k/v
    (D = 64: 32-column half-head tiles) in bf16."""
    shapes = [("swiglu", 3584, 18944, "K=3584 F=18944"), ("rope", 3584, 64, "K=3584 D=128"),
              ("rope", 896, 32, "K=896 D=64"), ("rope", 3584, 64, "K=3584 D=128 positions")]
    for dt in dtypes:
        torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
        for epilogue, K, half, label in shapes:
            by_pos = label.endswith("positions")  # the captured round's: cos / sin formed in the kernel
            if (K == 896 or by_pos) and dt != "bf16":
                continue
            BM, BN, BK = nl.tiles_for(161, half, torch_dt)  # the launcher's GPU tiles (no interpreter here)
            types = {n: "i32" for n in nl._norm_linear_kernel.arg_names}
            types.update(x_ptr=f"*{dt}", r_ptr=f"*{dt}", s_ptr=f"*{dt}", nw_ptr=f"*{dt}", w_ptr=f"*{dt}",
                         b_ptr=f"*{dt}", o_ptr=f"*{dt}", cos_ptr="*i64" if by_pos else "*fp32", sin_ptr="*fp32",
                         eps="fp32")
            ce = dict(HAS_NORM=True, HAS_RES=True, HAS_BIAS=epilogue == "rope", EPI=nl.EPILOGUES.index(epilogue),
                      ROPE_FP32=False, ROPE_POS=by_pos, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                      DOT_PREC="ieee" if torch_dt == torch.float32 else "tf32")
            out.append((f"_norm_linear_kernel {dt} {epilogue} {label}", nl._norm_linear_kernel, types, ce,
                        {"K", "stride_x", "stride_r", "stride_w", "out_cols"},
                        dict(num_warps=nl.NUM_WARPS[epilogue], num_stages=3, enable_fp_fusion=False)))


def _round_glue_variants(out, dtypes):
    """The round's guard (first_bad: one program over the LM-head rows) and commit (commit_round: Dream-7B's
    [Hkv x D] = 512-value rows, the last_logit row in 4,096-value chunks)."""
    types = dict(ok_ptr="*u8", rows_ptr="*i64", n_ptr="*i64", out_ptr="*i64", R="i32", n_int="i32", none="i32")
    out.append(("_first_bad_kernel", fb._first_bad_kernel, types, dict(N_PTR=True, BLOCK=fb.BLOCK), set(),
                dict(num_warps=4)))
    for dt in dtypes:
        types = {n: "i32" for n in cmr._commit_kernel.arg_names}
        types.update(ck_ptr=f"*{dt}", cv_ptr=f"*{dt}", kw_ptr=f"*{dt}", vw_ptr=f"*{dt}", cl_ptr="*i64", w_ptr="*i64",
                     u_ptr="*i64", last_ptr=f"*{dt}", lg_ptr=f"*{dt}", lr_ptr="*i64")
        ce = dict(HAS_LAST=True, BLOCK_HD=512, BLOCK_V=cmr.BLOCK_V)
        out.append((f"_commit_kernel {dt} Hkv*D=512", cmr._commit_kernel, types, ce, set(), dict(num_warps=4)))


def _head_confidence_variants(out, dtypes):
    """The fused head at Dream's vocabulary: a LoPA k=8 round's 64-row tiles (the launcher's GPU tiles)."""
    for dt in dtypes:
        torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
        BR, BV, BH = hc.tiles_for(289, 152064, 3584, torch_dt)  # the launcher's GPU tiles (no interpreter here)
        ce = dict(HAS_SUPPRESS=True, BLOCK_R=BR, BLOCK_V=BV, BLOCK_H=BH, STORE_LOGITS=True)  # the entropy round's
        types = {n: "i32" for n in hc._hc_stats_kernel.arg_names}
        types.update(h_ptr=f"*{dt}", w_ptr=f"*{dt}", pm1_ptr="*fp32", pi1_ptr="*i32", pm2_ptr="*fp32", ps_ptr="*fp32",
                     pfin_ptr="*i32", lg_ptr=f"*{dt}")
        out.append((f"_hc_stats_kernel {dt} V=152064", hc._hc_stats_kernel, types, ce,
                    {"stride_h", "stride_w", "H", "V"}, dict(num_warps=hc.NUM_WARPS, num_stages=3)))
        types = {n: "i32" for n in hc._hc_entropy_kernel.arg_names}
        types.update(lg_ptr=f"*{dt}", eps="fp32", lse_ptr="*fp32", pent_ptr="*fp32")
        out.append((f"_hc_entropy_kernel {dt} V=152064", hc._hc_entropy_kernel, types,
                    dict(HAS_SUPPRESS=True, BLOCK_R=BR, BLOCK_V=BV), {"V"}, dict(num_warps=hc.NUM_WARPS, num_stages=3)))
    types = {n: "*fp32" for n in hc._hc_merge_kernel.arg_names}
    types.update(pi1_ptr="*i32", pfin_ptr="*i32", tok_ptr="*i64", fin_ptr="*i8", S="i32")
    out.append(("_hc_merge_kernel S<=16", hc._hc_merge_kernel, types, dict(BLOCK_S=16), set(),
                dict(num_warps=1, num_stages=3)))


def ptxas_report(ptx: str, name: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"{name}.ptx"
        p.write_text(ptx)
        r = subprocess.run([str(PTXAS), "-arch=sm_90a", "-v", str(p), "-o", str(Path(d) / "out.cubin")],
                           capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed for {name}:\n{r.stderr}")
    txt = r.stderr + r.stdout
    regs = re.search(r"Used (\d+) registers", txt)
    spill_st = re.search(r"(\d+) bytes spill stores", txt)
    spill_ld = re.search(r"(\d+) bytes spill loads", txt)
    stack = re.search(r"(\d+) bytes stack frame", txt)
    return dict(regs=int(regs.group(1)) if regs else -1,
                spill=int(spill_st.group(1)) + int(spill_ld.group(1)) if spill_st else 0,
                stack=int(stack.group(1)) if stack else 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one variant per kernel, no results file")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernel_resources.md"))
    args = ap.parse_args(argv)
    rows, failed = [], []
    for label, fn, types, ce, aligned, opts in variants(args.quick):
        t0 = time.time()
        try:
            sig = _signature(fn, types, ce)
            src = ASTSource(fn, sig, constexprs=ce, attrs=_attrs(fn, sig, aligned))
            k = triton.compile(src, target=TARGET, options=opts)
            rep = ptxas_report(k.asm["ptx"], fn.__name__)
        except Exception as e:  # noqa: BLE001 - report every failing kernel, then fail
            failed.append(label)
            print(f"FAIL {label}: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        dt = time.time() - t0
        rows.append((label, opts["num_warps"], opts.get("num_stages", 1), rep["regs"], k.metadata.shared,
                     rep["spill"], rep["stack"], dt))
        print(f"ok   {label}: regs={rep['regs']} smem={k.metadata.shared} spill={rep['spill']}B "
              f"stack={rep['stack']}B ({dt:.1f}s)")
        if rep["spill"]:
            failed.append(label + " (spills)")
    if not args.quick and not failed:
        lines = [
            "# Triton kernel resources on sm_90 (compiled without a GPU)",
            "",
            f"Command: `python bench/compile_triton.py` (triton {triton.__version__}, GPUTarget('cuda', 90, 32), "
            "bundled ptxas -arch=sm_90a -v). Dream-7B shapes: Hq 28, Hkv 4 (G 7), D 128, V 152064. "
            "smem = Triton's dynamic shared memory (bytes).",
            "",
            tabulate([[*r[:7], f"{r[7]:.1f}"] for r in rows],
                     ["kernel", "warps", "stages", "registers/thread", "smem bytes", "spill bytes", "stack bytes",
                      "compile s"], tablefmt="github", disable_numparse=True),
        ]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    if failed:
        print("FAILED: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
