"""Which GenerateConfig knobs a request body may not set, and why (data only: the CLI builds `serve --help` from
it without importing the server's dependencies)."""

# knobs a request may not set, and why
NOT_SERVED = {
    "stop": "the body's stop is OpenAI's (text stops; token-id stops as lists of ints in it)",
    "return_trace": "the server returns no traces",
    "distributed": "the server runs one process (branch parallelism is set up per process group)",
}
# knobs only the operator sets (serve's flags), never a request: a client choosing `compile` would choose the server's
# compile cost (25-100 s of Inductor per new graph on CPU, behind the one-at-a-time lock); float knobs are runtime
# inputs of the compiled steps, so only new shapes or structural knobs add graphs (docs/serve.md)
OPERATOR_ONLY = {
    "compile": "an operator setting: `serve --compile` (captured / compiled buckets are the server's, not a request's)",
}
