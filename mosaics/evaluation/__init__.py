"""Evaluation suite: RegBench, length extrapolation (Sort, MQMTAR), language-model loss."""
