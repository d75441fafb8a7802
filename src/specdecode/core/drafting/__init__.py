"""Drafting: what proposes the tokens a target verifies, one file per drafter.

`base` holds the `Draft` and the `Drafter` protocol; `model` drafts with a small causal LM,
`lookup` by n-gram lookup in the text itself, `mixed` by lookup where the text repeats and the
model elsewhere under a planner (fixed: lookup first; priced: each as far as it pays).
`factory.make_drafter` builds one from the drafting setting (`config.DRAFTINGS`): the only
place that maps a setting's name to a drafter.
"""
