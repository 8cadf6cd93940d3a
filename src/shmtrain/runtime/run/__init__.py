"""One run of ``shmtrain train``: ``training`` (start local workers, or be one worker of a
torchrun job), ``start`` (its folder and the checkpoint it resumes), ``loop`` (the worker),
``monitor`` (rank 0's evaluation and scalars), ``torchrun`` (the torchrun job's side),
``end`` (the summary and how it ends).
"""
