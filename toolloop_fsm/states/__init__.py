"""States: each stage's entry actions and event handlers, one module per stage.

Every function here takes the `TurnState` (and the event being processed) and mutates
it, appending the effects the pump must carry out to ``turn.effects``. Nothing here
awaits, reads a clock or touches I/O.
"""
