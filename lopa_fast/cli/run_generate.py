"""`generate`: decode one prompt (any model; default the embedded one) and print the text, the stats, the JSON
object, the stream of final text or the live denoising view, and the fill-order PNG."""
from __future__ import annotations

import json
import os
import sys
import warnings

from lopa_fast.cli.checks import CLIError, check_out, read_prompt, user_errors
from lopa_fast.cli.flags import generate_knobs, model_path, preset_assets
from lopa_fast.request.text import encode_prompt


def load_model_args(args, tok=None):
    """(model, tokenizer) for --model / --lora / --dtype / --device (tok: the one `load_tokenizer_args` loaded)."""
    import torch

    import lopa_fast

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = model_path(args)  # --model, the preset's (the student's rows), or the embedded model
    if tok is None:
        tok = load_tokenizer_args(args)
    try:
        model = lopa_fast.load_model(path, dtype=args.dtype, device=device, lora=args.lora)  # None: default_dtype
    except OSError as e:
        raise CLIError(f"--model {path}: cannot read it ({e.strerror or type(e).__name__})") from e
    except RuntimeError as e:  # e.g. torch: the device does not exist on this machine
        if "device" in type(e).__name__.lower() or not device.startswith("cpu"):
            raise CLIError(f"--device {device}: {str(e).splitlines()[0]}") from e
        raise
    return model, tok


def load_tokenizer_args(args):
    """The tokenizer of --model (its config.json read and checked first: a missing or broken one is named before
    anything else), without the weights."""
    import lopa_fast
    from lopa_fast.models.checkpoint import read_config

    path = model_path(args)
    if args.model is not None and not os.path.isdir(path):
        from lopa_fast.models.checkpoint import hub_id_hint

        raise CLIError(f"--model {path}: not a directory (an HF-format model directory with config.json)"
                       + hub_id_hint(path))
    try:
        read_config(path)  # (CheckpointError / ConfigError: one line, exit 2)
        return lopa_fast.load_tokenizer(path)
    except OSError as e:
        raise CLIError(f"--model {path}: cannot read it ({e.strerror or type(e).__name__})") from e


def check_lengths_before_loading(args, cfg, n_prompt: int) -> None:
    """The request's length checks (`GenerateConfig.plan_length`: prompt + max_new_tokens against the model's
    max_position_embeddings, whole blocks, generation_config.json's default) on config.json alone, before the weights
    load: a too-long request costs no load (a 7B checkpoint's is ~10 s) and its error is the only line printed.
    generate runs them again on the loaded model."""
    from types import SimpleNamespace

    from lopa_fast.models.checkpoint import read_config

    path = model_path(args)
    stand_in = SimpleNamespace(config=read_config(path), name_or_path=str(path))  # what plan_length reads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a clipped default warns once, at generate)
        user_errors(cfg.plan_length, stand_in, n_prompt)


def load_verifier(args, model):
    """--verifier DIR: APD's causal AR verifier, loaded like the drafter (its dtype, its device); None without it."""
    import lopa_fast

    path = getattr(args, "verifier", None)
    if path is None:
        return None
    if not os.path.isdir(path):
        raise CLIError(f"--verifier {path}: not a directory (an HF-format causal qwen2 model directory, e.g. "
                       "lopa_fast/assets/ar-arith)")
    try:
        return lopa_fast.load_model(path, dtype=next(model.parameters()).dtype, device=model.device)
    except OSError as e:
        raise CLIError(f"--verifier {path}: cannot read it ({e.strerror or type(e).__name__})") from e

def check_verifier_flag(args, knobs: dict) -> None:
    """Before any load: --verifier given to a strategy that takes none, or a knob that needs one without it."""
    from lopa_fast import api
    from lopa_fast.config import GenerateConfig

    cfg = user_errors(lambda: GenerateConfig(**knobs).validate())
    user_errors(api.check_verifier_given, cfg, args.verifier is not None, "--verifier DIR")

def generate(args) -> int:
    import torch

    text = read_prompt(args)  # before any load: a bad prompt costs nothing
    knobs = generate_knobs(args, args.knob_names)
    _, verifier_asset = preset_assets(args.preset, args.model)
    if getattr(args, "verifier", None) is None and verifier_asset is not None:  # APD's presets: the task's verifier
        from lopa_fast.assets import model_dir

        args.verifier = str(model_dir(verifier_asset))
    if knobs.get("distributed"):  # launched by torchrun: the group must exist before the knob checks
        from lopa_fast.distributed import init_from_env

        if args.stream or args.show_steps:
            raise CLIError("--distributed prints the result once decoded; --stream / --show-steps are not supported "
                           "with it")
        args.device = init_from_env(args.device)  # NCCL -> cuda:LOCAL_RANK, gloo -> cpu
    try:
        return generate_one(args, text, knobs)
    finally:
        if knobs.get("distributed"):
            torch.distributed.destroy_process_group()

def generate_one(args, text: str, knobs: dict) -> int:
    import torch

    from lopa_fast import api
    from lopa_fast.config import GenerateConfig
    from lopa_fast.request.text import answer_text, split_stops, text_decoder

    want_trace = bool(knobs.get("return_trace"))  # --return-trace: the trace goes into --json's object
    if args.png is not None:
        check_out(args.png, f"--png {args.png}")
        knobs["return_trace"] = True  # the picture is drawn from the run's trace
    max_length = knobs.pop("max_length", None)
    if max_length is not None and knobs.get("max_new_tokens") is not None:
        raise CLIError(f"--max-length {max_length} and --max-new-tokens {knobs['max_new_tokens']} both given; pass one")
    if max_length is not None and max_length < 2:
        raise CLIError(f"--max-length {max_length}; allowed: an int > the prompt's length (prompt + new tokens)")
    check_verifier_flag(args, knobs)  # before any load
    tok = load_tokenizer_args(args)  # the tokenizer first: the request is checked before the weights load
    ids = encode_prompt(tok, text, args.chat, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    if max_length is not None:
        from lopa_fast.request import aliases

        knobs = user_errors(aliases.translate, {**knobs, "max_length": max_length}, [len(ids)])
    seqs, texts = user_errors(split_stops, tok, args.stop_text)  # text stops: tokenised + matched on the text
    if seqs:
        knobs["stop"] = [*(knobs.get("stop") or []), *seqs]
    cfg = user_errors(lambda: GenerateConfig(**knobs).validate())
    check_lengths_before_loading(args, cfg, len(ids))
    model, tok = load_model_args(args, tok)
    verifier = load_verifier(args, model)
    ids_t = torch.tensor(ids, dtype=torch.long, device=model.device)
    decode = text_decoder(tok)
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else model.eos_token_id

    def check():  # the checks generate runs before any forward, here so their ValueError / TypeError exit 2
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # generate itself warns once, below
            planned, _ = cfg.plan_length(model, ids_t.numel())
            bound = planned.resolve(model)
            api.check_prompt(model, api.prepare_prompt(model, ids_t), bound)
            api.resolve_backend(bound, hook=args.stream or args.show_steps)
            api.check_pair(model, verifier, ids_t, bound)

    user_errors(check)
    for note in cfg.sampling_notes():
        print(f"warning: {note}", file=sys.stderr)
    if args.stream or args.show_steps:
        answer, out = stream_text(args, model, tok, ids_t, knobs, texts, verifier)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".* has no effect at temperature=0")  # printed above
            out = api.generate_with_config(model, ids_t, cfg, verifier=verifier)
        answer = answer_text(out, decode, eos, texts)
    st = out.stats
    if cfg.distributed and torch.distributed.get_rank() != 0:  # every rank holds the result; rank 0 prints it
        return 0
    if args.json:
        obj = {"text": answer, "generated_ids": out.generated_ids, "stats": st}
        if want_trace and out.trace is not None:
            obj["trace"] = out.trace
        print(json.dumps(obj, default=str))
    else:
        if not args.stream:
            print(answer)
        print(f"{st['strategy']} ({st['backend']}): TPF {st['tpf']:.2f}, forwards {st['forwards']}, "
              f"{st['generated_tokens']} tokens, finish_reason {st['finish_reason']}, "
              f"wall {1000 * st['seconds']:.0f} ms" + (f"; {st['max_new_tokens_clipped']}"
                                                       if "max_new_tokens_clipped" in st else ""), file=sys.stderr)
    if args.png is not None:
        write_png(out, tok, args.png)
    return 0

def stream_text(args, model, tok, ids_t, knobs, text_stops, verifier=None):
    """--stream: print the text as it becomes final (lopa_fast.stream); --show-steps: the live denoising view
    (lopa_fast.viz.StepView: redrawn in place on a terminal, one line per round otherwise). (text, output)."""
    import lopa_fast
    from lopa_fast.viz import StepView

    view = None
    if args.show_steps:
        view = StepView(lambda ids: [tok.decode([t]) for t in ids])
    knobs = dict(knobs)
    stop = [*(knobs.pop("stop", None) or []), *text_stops] or None
    s = user_errors(lopa_fast.stream, model, ids_t, tokenizer=tok, stop=stop, verifier=verifier,
                     on_round=view, **knobs)
    with s:
        for piece in s:
            if args.stream:
                print(piece, end="", flush=True)
    if args.stream:
        print(flush=True)
    return s.text, s.result

def write_png(out, tok, path) -> None:
    """The fill-order heatmap of a traced run (`lopa_fast.viz.fill_order_png`), one cell per returned token."""
    from lopa_fast import viz

    if not out.trace:
        raise CLIError(f"--png {path}: strategy {out.stats['strategy']!r} returned no trace to draw")
    st = out.stats
    tokens = [str(t) for t in tok.convert_ids_to_tokens(out.generated_ids)]
    title = (f"fill order: {st['strategy']} ({st['backend']}), {len(tokens)} tokens, {st['forwards']} forwards, "
             f"TPF {st['tpf']:.2f}")
    try:
        viz.fill_order_png(out.trace, path, tokens=tokens, title=title)
    except OSError as e:
        raise CLIError(f"--png {path}: cannot write it ({e.strerror or type(e).__name__})") from e
    print(f"wrote {path} (fill order)", file=sys.stderr)
