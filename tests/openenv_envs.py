"""Two small OpenEnv environments the tests serve with openenv-core's own server (`create_app`, uvicorn):

- `guess_app`: guess a number from 1 to 20; the action is one string (`message`), so a turn's text is the action;
  the target is the row's `target`, else drawn from the reset's seed; reward 1 and done on the right guess;
- `walk_app`: walk to a goal on a line; the action is an integer (`steps`), so the model calls the `step` tool;
  the observation has two fields (position and goal), sent as JSON; reward 1 and done at the goal.
"""

from __future__ import annotations

import random
import re
from typing import Any, Optional

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""


class Guess(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **row: Any) -> GuessObservation:
        self.target = int(row["target"]) if "target" in row else random.Random(seed).randint(1, 20)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="Guess a number from 1 to 20.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        said = re.findall(r"-?\d+", action.message)
        if not said:
            return GuessObservation(prompt="Say a number.", reward=0.0)
        guess = int(said[-1])
        if guess == self.target:
            return GuessObservation(prompt="Correct!", reward=1.0, done=True)
        hint = "Higher." if guess < self.target else "Lower."
        return GuessObservation(prompt=hint, reward=0.0, done=self._state.step_count >= 5)

    @property
    def state(self) -> State:
        return self._state


class WalkAction(Action):
    """Walk some steps along the line (negative: back)."""

    steps: int


class WalkObservation(Observation):
    position: int = 0
    goal: int = 0


class Walk(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **row: Any) -> WalkObservation:
        self.position, self.goal = 0, int(row.get("goal", 3))
        self._state = State(episode_id=episode_id, step_count=0)
        return WalkObservation(position=0, goal=self.goal)

    def step(self, action: WalkAction, timeout_s: Optional[float] = None, **kwargs: Any) -> WalkObservation:
        self._state.step_count += 1
        if abs(action.steps) > 10:
            raise ValueError(f"at most 10 steps at once, not {action.steps}")
        self.position += action.steps
        at_goal = self.position == self.goal
        return WalkObservation(position=self.position, goal=self.goal, reward=float(at_goal), done=at_goal)

    @property
    def state(self) -> State:
        return self._state


guess_app = create_app(Guess, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16)
walk_app = create_app(Walk, WalkAction, WalkObservation, env_name="walk", max_concurrent_envs=16)
