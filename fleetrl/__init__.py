"""fleetrl core: what every role shares (logging, typed-config machinery, data, models).

The role packages (``learner``, ``rollout_fleet``, ``buffer``, ``weight_sync``) sit
beside this one at the top level, as the design card lays them out; the driver
(``launcher``) composes them. Importing this package is cheap and has no side effects.
"""

__version__ = "0.1.0"
