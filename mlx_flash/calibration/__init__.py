"""Calibration: what a pack's predictors come from.

    dense_pass.py  the pack's model rebuilt dense, recording every layer's FFN inputs over text
    fit.py         thresholds, predictor fits and their held-out statistics, written into the pack
    quality.py     perplexity and greedy agreement of a run mode against dense; the sparsity sweep
    synthetic.py   random packs shaped like a real model, with exact predictors (speed only)
"""
