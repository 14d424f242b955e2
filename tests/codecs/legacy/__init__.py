"""The codecs as they were at commit abb5dc3, before the pass-count work of issue 23: frozen
copies, imported only by the tests, as the oracle the faster code must match bit for bit.

Only imports were changed (to point at each other). Do not edit: a change here would move the
reference along with the code it checks.
"""
