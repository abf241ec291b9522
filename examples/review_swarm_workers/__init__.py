"""The review swarm with its drafts written by ``runstate worker`` processes instead of Celery.

``handlers.py`` holds the drafting handler, a plain ``consume()`` handler; ``__main__.py``
is the driver (the same reviewer as ``examples.review_swarm``). See README.md here.
"""

# A mailbox of its own: the Celery example binds "drafts" to its decorated task, and a
# service started for that example would hand these drafts to Celery instead.
MAILBOX = "worker-drafts"
