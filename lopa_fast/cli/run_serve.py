"""`serve`: the OpenAI-compatible server (lopa_fast.server) on a model, its defaults checked before any load."""
from __future__ import annotations

import logging
import os
import sys

from lopa_fast.cli.checks import CLIError, user_errors
from lopa_fast.cli.flags import generate_knobs
from lopa_fast.cli.run_generate import load_model_args, load_verifier


def serve(args) -> int:
    """`serve`: the OpenAI-compatible server (lopa_fast.server) on --model (default the embedded model). Its default
    knobs: GenerateConfig's, then the model's generation_config.json sampling, then the --preset / flags given
    (the embedded model: lopa-k4 as `generate`); every request may override them."""
    try:
        from lopa_fast import server
    except ModuleNotFoundError as e:
        if e.name not in ("fastapi", "uvicorn", "starlette"):
            raise
        raise CLIError(f"serve: {e.name} is not installed; pip install '.[serve]' (fastapi, uvicorn)") from e
    from lopa_fast.config import GenerateConfig
    from lopa_fast.server.served import NOT_SERVED

    if not 0 <= args.port < 65536:
        raise CLIError(f"--port {args.port}; allowed: 0..65535")
    if not args.drain_timeout >= 0:
        raise CLIError(f"--drain-timeout {args.drain_timeout}; allowed: seconds >= 0")
    knobs = generate_knobs(args, args.knob_names)
    refused = [k for k in knobs if k in NOT_SERVED]
    if refused:
        raise CLIError(f"serve: --{refused[0].replace('_', '-')} is not a server default ({NOT_SERVED[refused[0]]})")
    api_key = args.api_key if args.api_key is not None else (os.environ.get(server.API_KEY_ENV) or None)
    if args.api_key is not None and not args.api_key.strip():
        raise CLIError("--api-key is empty; pass a key, or --no-api-key to serve without one")
    try:
        server.check_auth(args.host, api_key, args.no_api_key)
        limits = server.Limits(max_branching_factor=args.max_branching_factor, max_model_len=args.max_model_len,
                               max_num_seqs=args.max_num_seqs, max_batch_rows=args.max_batch_rows,
                               max_body_bytes=args.max_body_bytes, read_timeout_s=args.read_timeout,
                               min_body_rate=args.min_body_rate, step_timeout_s=args.step_timeout,
                               max_request_memory=None if args.max_request_memory is None
                               else int(args.max_request_memory * 2**30),
                               memory_budget=None if args.memory_budget is None else int(args.memory_budget * 2**30))
    except ValueError as e:
        raise CLIError(f"serve: {e}") from e
    try:
        server.check_address(args.host, args.port)  # before the load: a busy port costs nothing
    except OSError as e:
        raise CLIError(f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})") from e
    if "max_length" in knobs:
        raise CLIError("serve: --max-length is prompt + new tokens, which a server default cannot know; pass "
                       "--max-new-tokens (a request's max_tokens)")
    from lopa_fast import api, strategies

    def check_defaults(defaults):  # a default that needs the verifier, without one: before any load
        cfg = user_errors(lambda: GenerateConfig(**defaults).validate())
        given = args.verifier is not None and strategies.get(cfg.strategy).takes_verifier
        user_errors(api.check_verifier_given, cfg, given, "serve --verifier DIR")

    check_defaults(knobs)
    if args.verifier is not None and not os.path.isdir(args.verifier):
        raise CLIError(f"--verifier {args.verifier}: not a directory (an HF-format causal qwen2 model directory)")
    model, tok = load_model_args(args)
    path = model.name_or_path if getattr(model, "name_or_path", None) else args.model
    defaults = {**user_errors(server.model_sampling_defaults, path), **knobs}
    check_defaults(defaults)
    verifier = load_verifier(args, model)
    if verifier is not None:  # one verifier for the server's life: checked against the drafter now
        import lopa_fast

        user_errors(api.check_verifier_fits, model, verifier, tok, lopa_fast.load_tokenizer(args.verifier))
    name = args.model_name or os.path.basename(os.path.normpath(str(path)))
    print(f"serving {name} on http://{args.host}:{args.port} (defaults: {defaults})", file=sys.stderr, flush=True)
    server.serve(model, tok, model_id=name, defaults=defaults, host=args.host, port=args.port,
                 log_level=logging.getLevelName(args.log_level).lower(),  # uvicorn's lines follow -q / -v too
                 limits=limits, api_key=api_key, verifier=verifier, access_log=args.access_log,
                 log_prompts=args.log_prompts,
                 drain_timeout_s=args.drain_timeout)
    return 0
