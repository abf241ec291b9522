"""The domain's vocabulary and pure rules: no database, no Django model, imported by every layer.

- ``states``: every status field's values, and the sets of them the rules use;
- ``exceptions``: the domain errors with their stable codes (DESIGN.md "Error codes");
- ``ids``: time-ordered UUIDs, claim and delivery fences, run paths;
- ``group_rules``: when a group is decided (the condition table), from its counts;
- ``task_errors``: what a task's ``error`` may be, and how to read its code.
"""
