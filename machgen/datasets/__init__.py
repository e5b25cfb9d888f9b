"""The synthetic datasets the default models were trained on, and their detectors (numpy only).

`shapes`: 64x64 pictures of one coloured shape at a named place; `moving_shapes`: clips of one moving.
The builder trains and evaluates on them, the API scores with their detectors and the benchmarks draw
their prompts from them; none of those imports the others through here.
"""
