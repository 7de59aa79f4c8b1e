"""The request front door: a call's arguments turned into one validated `Plan` (request.plan) before any forward.

aliases (HF / Dream / LLaDA knob names), knobs (one value's checks), prompts (input_ids), text (tokenizer in/out),
model_defaults (a checkpoint's own knobs), verifiers (a second model), decoder (the fast decoder or the reference),
prompt_batch (a list of prompts), threads (the CPU thread policy). lopa_fast.api runs the plan.
"""
