"""The end of a request: the decoded whole blocks cut to the requested length (and before a stop sequence), the
stats that describe the returned tokens, and how the output ended (`finish_reason`)."""
from __future__ import annotations

from lopa_fast.config import GenerateConfig
from lopa_fast.output.progress import first_stop
from lopa_fast.output import GenerateOutput


def cut_to_length(out: GenerateOutput, length: dict, cfg: GenerateConfig) -> GenerateOutput:
    """Cut the decoded whole blocks to the requested length and record how the output ended.

    stats: max_new_tokens (the request the output is cut to), decoded_new_tokens (the whole blocks decoded),
    max_new_tokens_source ("argument" | "generation_config.json" | "default"), max_new_tokens_clipped (the reason,
    only when a default was clipped to the position limit), finish_reason ("round_cap": the loop stopped at
    max_rounds, stats["hit_round_cap"]; else "stop": the returned tokens hold an EOS; else "length"; a stop
    sequence (cfg.stop) in the finalised prefix cuts the output before it: finish_reason "stop" first,
    stats["stop_sequence_at"] its position). After a cut
    the token counts (generated_tokens, tokens_until_eos, tpf, tpf_until_eos, tokens_per_second, masks_left)
    describe the returned tokens, and the trace's `accepted` lists drop the positions past the cut (its entries,
    one per round / forward, stay); forwards describe the decoding.
    """
    n = length["requested"]
    st = out.stats
    stop_at = first_stop(out.generated_ids[:n], cfg.stop, cfg.mask_token_id) if cfg.stop else None
    if stop_at is not None:  # a stop sequence in the finalised prefix: the output ends before it
        n = stop_at
        st["stop_sequence_at"] = stop_at
    if len(out.generated_ids) > n:
        ids = out.generated_ids = list(out.generated_ids[:n])
        fw, eos = int(st.get("forwards", 0)), cfg.eos_token_id
        until = ids.index(eos) + 1 if eos is not None and eos in ids else len(ids)
        st["generated_tokens"], st["tokens_until_eos"] = len(ids), until
        st["tpf"] = len(ids) / fw if fw else 0.0
        st["tpf_until_eos"] = until / fw if fw else 0.0
        sec = st.get("seconds", 0.0)
        st["tokens_per_second"] = len(ids) / sec if sec > 0 else 0.0
        st["masks_left"] = sum(1 for t in ids if t == cfg.mask_token_id)
        if out.trace is not None:
            for entry in out.trace:
                if "accepted" in entry:
                    entry["accepted"] = [a for a in entry["accepted"] if int(a[0]) < n]
    st["max_new_tokens"] = n
    st["decoded_new_tokens"] = length["decoded"]
    st["max_new_tokens_source"] = length["source"]
    if "clipped" in length:
        st["max_new_tokens_clipped"] = length["clipped"]
    eos = cfg.eos_token_id
    if stop_at is not None:
        st["finish_reason"] = "stop"
    elif st.get("hit_round_cap"):
        st["finish_reason"] = "round_cap"
    else:
        st["finish_reason"] = "stop" if eos is not None and eos in out.generated_ids else "length"
    return out
