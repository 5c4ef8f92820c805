"""The benchmark's workload: the same tasks on every device, so results compare.

Support tickets, as an orchestrator fans them out: one extraction schema (a few fields, a bounded summary, a
short list) and one set of routing labels over the same texts. Made from fixed lists with a fixed seed.
"""

from __future__ import annotations

import random
from typing import Any

TICKET_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False,
    "required": ["customer", "product", "priority", "summary", "tags"],
    "properties": {
        "customer": {"type": "string", "maxLength": 60},
        "product": {"type": "string", "maxLength": 60},
        "priority": {"enum": ["low", "normal", "high", "urgent"]},
        "summary": {"type": "string", "maxLength": 200},
        "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 24}},
    },
}
ROUTES = ["billing", "bug", "hardware", "account", "feedback"]

_NAMES = ["Maria Lopez", "Ken Watanabe", "Aisha Bello", "Tom Novak", "Lena Berg", "Ravi Rao", "Zoë Dubois",
          "Łukasz Nowak"]
_PRODUCTS = ["the X200 router", "our billing portal", "the mobile app", "the SmartThermo", "invoice export",
             "my account page"]
_ISSUES = ["keeps dropping the connection every evening", "charged me twice this month",
           "crashes when I open settings", "shows the wrong temperature since the update",
           "produces empty CSV files", "will not accept my new password"]
_ENDINGS = ["Please fix it soon.", "This is the third time!", "Not urgent, just so you know.",
            "Can someone call me back?"]
# a longer filler for prompt-speed runs: prompt tokens at a chosen length
FILLER = ("The committee reviewed the minutes, the budget and the schedule for the coming quarter, and agreed to "
          "revisit the remaining items at the next session. ")


def tickets(n: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(_NAMES)} writes: {rng.choice(_PRODUCTS)} {rng.choice(_ISSUES)}. {rng.choice(_ENDINGS)}"
            for _ in range(n)]
