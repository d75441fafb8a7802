"""`specdecode bench`: decoding methods compared on the same prompts and models, in one process.

`metrics` holds the arithmetic (Leviathan bound, ratios and means), `methods` the decoding
methods behind one call signature, `runner` the interleaved measurement with its checks, and
`report` the JSON record, Markdown table and plots.
"""
