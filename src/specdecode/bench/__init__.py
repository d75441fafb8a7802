"""`specdecode bench`: decoding methods compared on the same inputs and models, in one process.

`methods` holds the protocol every method meets (`BenchMethod`) and the registry of causal
methods (`CAUSAL`), `seq2seq` the translation methods (`SEQ2SEQ`) and their set-up, `runner` the
one interleaved measurement with its checks (and the causal set-up), `metrics` the arithmetic
(Leviathan bound, ratios and means), and `report` the JSON record, Markdown table and plots of
any run.
"""
