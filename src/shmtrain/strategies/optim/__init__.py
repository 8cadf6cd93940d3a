"""How an optimizer is stepped when a strategy splits the step: ``partial_step`` (over part of
the parameters at a time) and ``grad_safety`` (whether a step writes into the gradients it reads).
"""
