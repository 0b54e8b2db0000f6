"""Expert parallelism: a mixture-of-experts block's experts spread over the ranks of a
mesh dim, tokens routed to them with all-to-all in uneven splits.

::

    rank 0 tokens --route--> pairs (token, expert) --dispatch--> experts 0..E/p-1 --combine--+
    rank 1 tokens --route--> pairs                 --dispatch--> experts E/p..   --combine--+
                                      (all_to_all, uneven)                  (all_to_all)   |
    each rank: its tokens' results, in token order, weighted by its router <---------------+

* :class:`ExpertParallel` (``style.py``): the parallel style (``parallelize_module``);
* ``routing.py``: steps 1-6 of one call (sort, count, dispatch, experts, combine, sum);
* ``exchange.py``: the all-to-alls as autograd Functions, and the router's gradient sum.

How many tokens each rank sends each expert is uneven by nature (the router decides): the
all-to-alls carry exactly the routed rows, no padding (the guide: *Expert parallelism*).
"""

from shardlab.experts.style import ExpertParallel

__all__ = ["ExpertParallel"]
