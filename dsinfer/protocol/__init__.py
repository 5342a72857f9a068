"""The wire protocol layer: API schemas, validation into SamplingParams, special-token-safe chat encoding,
tool-call and reasoning parsers.

Only the server imports this package (it needs pydantic); ``import dsinfer`` and the engine never do.
"""
