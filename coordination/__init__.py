"""The coordination domain: runs, work, groups, barriers, timers and their events."""
