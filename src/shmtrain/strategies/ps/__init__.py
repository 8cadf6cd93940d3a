"""The parameter servers of SHM-Learn-Dist (Biswas): ``grad`` (GRAD-AVG, eq. 2.1) and
``weight`` (WEIGHT-AVG, eq. 2.2).
"""
