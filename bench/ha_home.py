"""A generated home as Home Assistant shows it to an LLM: its system prompt, its Assist tools, commands.

Home Assistant's conversation agents (the Ollama integration, the OpenAI-compatible
ones) send one system message: the Assist instructions, then "Static Context", a YAML
list of every exposed entity (names, domain, areas), and the Assist API's tools as JSON
schemas converted from its voluptuous intent schemas (every slot optional unless the
intent needs it). This module builds that shape for a home of 71 entities in 13 areas,
and a set of spoken commands with the call Home Assistant needs for each, so benchmarks
can measure whether a command *works* (bench/ha_commands.py) and how long a turn takes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from decoding.tool_grammar import CALL_START, HERMES_OPEN, INLINE_CALL


@dataclass(frozen=True)
class Entity:
    name: str
    domain: str
    area: str


def _home() -> list[Entity]:
    rows = {
        "Kitchen": [("Kitchen Ceiling Light", "light"), ("Kitchen Under-Cabinet Lights", "light"),
                    ("Coffee Maker", "switch"), ("Dishwasher", "switch"), ("Kitchen Speaker", "media_player"),
                    ("Kitchen Temperature", "sensor"), ("Kitchen Window Blind", "cover")],
        "Living Room": [("Living Room Lamp", "light"), ("Living Room Ceiling Light", "light"),
                        ("Living Room TV", "media_player"), ("Living Room Thermostat", "climate"),
                        ("Living Room Curtains", "cover"), ("Living Room Fan", "fan"),
                        ("Living Room Humidity", "sensor"), ("Movie Night", "scene")],
        "Dining Room": [("Dining Room Chandelier", "light"), ("Dining Room Speaker", "media_player"),
                        ("Dining Room Window", "binary_sensor")],
        "Bedroom": [("Bedroom Ceiling Light", "light"), ("Bedside Lamp", "light"),
                    ("Bedroom Blinds", "cover"), ("Bedroom Speaker", "media_player"),
                    ("Bedroom Ceiling Fan", "fan"), ("Bedroom Temperature", "sensor"),
                    ("Electric Blanket", "switch"), ("Good Night", "scene")],
        "Kids Room": [("Kids Room Light", "light"), ("Night Light", "light"), ("Kids Room Heater", "climate"),
                      ("Kids Room Temperature", "sensor")],
        "Office": [("Office Desk Lamp", "light"), ("Office Ceiling Light", "light"),
                   ("Office Speaker", "media_player"), ("Printer", "switch"), ("Office Window Blind", "cover"),
                   ("Office CO2", "sensor"), ("Office Air Purifier", "fan")],
        "Bathroom": [("Bathroom Mirror Light", "light"), ("Bathroom Ceiling Light", "light"),
                     ("Towel Warmer", "switch"), ("Bathroom Humidity", "sensor"), ("Bathroom Fan", "fan")],
        "Hallway": [("Hallway Light", "light"), ("Front Door Lock", "lock"), ("Front Door", "binary_sensor"),
                    ("Hallway Motion", "binary_sensor"), ("Doorbell", "binary_sensor")],
        "Garage": [("Garage Door", "cover"), ("Garage Light", "light"), ("Car Charger", "switch"),
                   ("Side Door Lock", "lock"), ("Freezer Temperature", "sensor")],
        "Garden": [("Garden Lights", "light"), ("Garden Sprinkler", "switch"), ("Back Door Lock", "lock"),
                   ("Outdoor Temperature", "sensor"), ("Patio Heater", "switch"), ("Pool Pump", "switch")],
        "Laundry Room": [("Washing Machine", "switch"), ("Dryer", "switch"), ("Laundry Light", "light")],
        "Basement": [("Basement Light", "light"), ("Dehumidifier", "switch"), ("Water Leak Sensor", "binary_sensor"),
                     ("Basement Temperature", "sensor")],
        "Guest Room": [("Guest Room Light", "light"), ("Guest Room Thermostat", "climate"),
                       ("Guest Room Blinds", "cover")],
    }
    out = [Entity(n, d, a) for a, items in rows.items() for n, d in items]
    out += [Entity("Shopping List", "todo", ""), Entity("To-do", "todo", ""), Entity("Hoover", "vacuum", "")]
    return out


HOME: tuple[Entity, ...] = tuple(_home())
BY_NAME = {e.name: e for e in HOME}


def static_context(entities=HOME) -> str:
    """The YAML Home Assistant writes under "Static Context" (names, domain, areas; no states)."""
    lines = []
    for e in entities:
        lines += [f"- names: {e.name}", f"  domain: {e.domain}"]
        if e.area:
            lines.append(f"  areas: {e.area}")
    return "\n".join(lines)


# The Assist API's instructions (homeassistant/helpers/llm.py), in our words where they are prose.
INSTRUCTIONS = """You are a voice assistant for Home Assistant.
Answer questions about the world truthfully.
Answer in plain text. Keep it simple and to the point.
When controlling Home Assistant always call the intent tools. Use HassTurnOn to lock and HassTurnOff to unlock a lock. When controlling a device, prefer passing just name and domain. When controlling an area, prefer passing just area name and domain.
When a user asks to turn on all devices of a specific type, ask user to specify an area, unless there is only one device of that type.
You ARE equipped to answer questions about the current state of the home using the `GetLiveContext` tool. This is a primary function. Do not state you lack the functionality if the question requires live data.
If the user asks about device existence/type (e.g., "Do I have lights in the bedroom?"): Answer from the static context below.
If the user asks about the CURRENT state, value, or mode (e.g., "Is the lock locked?", "Is the fan on?", "What mode is the thermostat in?", "What is the temperature outside?"):
    1.  Recognize this requires live data.
    2.  You MUST call `GetLiveContext`. This tool will provide the needed real-time information (like temperature from the local weather, lock status, etc.).
    3.  Use the tool's response to answer the user accurately (e.g., "The temperature outside is [value from tool].").
For general knowledge questions not about the home: Answer truthfully from internal knowledge."""


def system_prompt(entities=HOME) -> str:
    return (f"{INSTRUCTIONS}\nStatic Context: An overview of the areas and the devices in this smart home:\n"
            f"{static_context(entities)}\n")


_DOMAINS = sorted({e.domain for e in HOME})
_TARGET = {"name": {"type": "string"}, "area": {"type": "string"}, "floor": {"type": "string"},
           "domain": {"type": "array", "items": {"type": "string", "enum": _DOMAINS}},
           "device_class": {"type": "array", "items": {"type": "string"}}}


def _tool(name: str, description: str, props: dict, required: list[str] | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required or []}}}


def _pct(extra: dict | None = None) -> dict:
    return {"type": "integer", "minimum": 0, "maximum": 100, **(extra or {})}


# The Assist API's tools as Home Assistant sends them (voluptuous -> OpenAPI schemas).
TOOLS = [
    _tool("HassTurnOn", "Turns on/opens/presses a device or entity. For locks, this performs a 'lock' action.",
          dict(_TARGET)),
    _tool("HassTurnOff", "Turns off/closes a device or entity. For locks, this performs an 'unlock' action.",
          dict(_TARGET)),
    _tool("HassSetPosition", "Sets the position of a device or entity",
          {**_TARGET, "position": _pct()}, ["position"]),
    _tool("HassLightSet", "Sets the brightness percentage or color of a light",
          {"name": {"type": "string"}, "area": {"type": "string"}, "floor": {"type": "string"},
           "domain": {"type": "array", "items": {"type": "string", "enum": ["light"]}},
           "color": {"type": "string"}, "temperature": {"type": "integer"}, "brightness": _pct()}),
    _tool("HassClimateSetTemperature", "Sets the target temperature of a climate device or entity",
          {"name": {"type": "string"}, "area": {"type": "string"}, "floor": {"type": "string"},
           "temperature": {"type": "number"}}, ["temperature"]),
    _tool("HassMediaPause", "Pauses a media player", dict(_TARGET)),
    _tool("HassMediaUnpause", "Resumes a media player", dict(_TARGET)),
    _tool("HassMediaNext", "Skips a media player to the next item", dict(_TARGET)),
    _tool("HassSetVolume", "Sets the volume percentage of a media player",
          {**_TARGET, "volume_level": _pct()}, ["volume_level"]),
    _tool("HassStartTimer", "Starts a new timer",
          {"hours": {"type": "integer", "minimum": 0}, "minutes": {"type": "integer", "minimum": 0},
           "seconds": {"type": "integer", "minimum": 0}, "name": {"type": "string"},
           "conversation_command": {"type": "string"}}),
    _tool("HassCancelTimer", "Cancels a timer",
          {"start_hours": {"type": "integer"}, "start_minutes": {"type": "integer"},
           "start_seconds": {"type": "integer"}, "name": {"type": "string"}, "area": {"type": "string"}}),
    _tool("HassListAddItem", "Add item to a todo list",
          {"item": {"type": "string"}, "name": {"type": "string"}}, ["item", "name"]),
    _tool("HassVacuumStart", "Starts a vacuum", {"name": {"type": "string"}, "area": {"type": "string"}}),
    _tool("HassGetCurrentTime", "Gets the current time", {}),
    _tool("HassGetCurrentDate", "Gets the current date", {}),
    _tool("GetLiveContext", "Provides real-time information about the CURRENT state, value, or mode of devices, "
                            "sensors, entities, or areas. Use this tool for: 1. Answering questions about current "
                            "conditions (e.g., 'Is the light on?'). 2. As the first step in conditional actions "
                            "(e.g., 'If the weather is rainy, turn off sprinklers' requires checking the weather "
                            "first).", {}),
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]


@dataclass(frozen=True)
class Command:
    """A spoken command and what Home Assistant needs to carry it out.

    ``tool`` None: a question the model should answer in words. ``args``: the
    acceptable argument sets (any one); ``target`` names the entity (or area)
    so that extra ``domain``/``area`` slots can be checked for consistency.
    """

    text: str
    tool: str | None
    args: tuple[dict[str, Any], ...] = ({},)
    target: str | None = None
    area: str | None = None
    domains: tuple[str, ...] = field(default=())


def _on(text, tool, name, **extra) -> Command:
    e = BY_NAME[name]
    return Command(text, tool, ({"name": name, **extra},), target=name, area=e.area or None, domains=(e.domain,))


def _area(text, tool, area, domain, **extra) -> Command:
    return Command(text, tool, ({"area": area, "domain": [domain], **extra},), area=area, domains=(domain,))


COMMANDS: tuple[Command, ...] = (
    _on("Turn on the kitchen ceiling light", "HassTurnOn", "Kitchen Ceiling Light"),
    _on("Switch off the hallway light", "HassTurnOff", "Hallway Light"),
    _on("Turn on the coffee maker", "HassTurnOn", "Coffee Maker"),
    _on("Open the garage door", "HassTurnOn", "Garage Door"),
    _on("Close the living room curtains", "HassTurnOff", "Living Room Curtains"),
    _on("Lock the front door", "HassTurnOn", "Front Door Lock"),
    _on("Pause the living room TV", "HassMediaPause", "Living Room TV"),
    _on("Skip to the next song on the kitchen speaker", "HassMediaNext", "Kitchen Speaker"),
    _on("Set the bedroom speaker volume to 25", "HassSetVolume", "Bedroom Speaker", volume_level=25),
    _on("Set the bedroom blinds to 40 percent", "HassSetPosition", "Bedroom Blinds", position=40),
    _on("Dim the office desk lamp to 30 percent", "HassLightSet", "Office Desk Lamp", brightness=30),
    Command("Set the living room thermostat to 21 degrees", "HassClimateSetTemperature",
            ({"name": "Living Room Thermostat", "temperature": 21}, {"area": "Living Room", "temperature": 21}),
            target="Living Room Thermostat", area="Living Room", domains=("climate",)),
    Command("Set a timer for 10 minutes", "HassStartTimer", ({"minutes": 10},)),
    Command("What time is it?", "HassGetCurrentTime"),
    Command("Is the front door locked?", "GetLiveContext"),
    Command("Add milk to my shopping list", "HassListAddItem", ({"item": "milk", "name": "Shopping List"},)),
    _area("Turn off all the lights in the living room", "HassTurnOff", "Living Room", "light"),
    _on("Activate movie night", "HassTurnOn", "Movie Night"),
    _on("Turn on the bedroom ceiling fan", "HassTurnOn", "Bedroom Ceiling Fan"),
    Command("How many legs does a spider have?", None),
    # --quick stops here (20); the full set goes on.
    _on("Turn off the garden sprinkler", "HassTurnOff", "Garden Sprinkler"),
    _on("Unlock the back door", "HassTurnOff", "Back Door Lock"),
    _on("Turn on the bedside lamp", "HassTurnOn", "Bedside Lamp"),
    _on("Switch on the electric blanket", "HassTurnOn", "Electric Blanket"),
    _on("Turn off the dishwasher", "HassTurnOff", "Dishwasher"),
    _on("Open the kitchen window blind", "HassTurnOn", "Kitchen Window Blind"),
    _on("Resume the office speaker", "HassMediaUnpause", "Office Speaker"),
    _on("Turn the dining room speaker volume up to 60", "HassSetVolume", "Dining Room Speaker", volume_level=60),
    _on("Make the dining room chandelier blue", "HassLightSet", "Dining Room Chandelier", color="blue"),
    _on("Set the kids room light to 10 percent brightness", "HassLightSet", "Kids Room Light", brightness=10),
    Command("Set the guest room thermostat to 18", "HassClimateSetTemperature",
            ({"name": "Guest Room Thermostat", "temperature": 18}, {"area": "Guest Room", "temperature": 18}),
            target="Guest Room Thermostat", area="Guest Room", domains=("climate",)),
    _on("Close the garage door", "HassTurnOff", "Garage Door"),
    _on("Turn on the car charger", "HassTurnOn", "Car Charger"),
    _on("Start the pool pump", "HassTurnOn", "Pool Pump"),
    _on("Turn on the good night scene", "HassTurnOn", "Good Night"),
    _area("Turn on the lights in the bathroom", "HassTurnOn", "Bathroom", "light"),
    _area("Close all the blinds in the office", "HassTurnOff", "Office", "cover"),
    Command("Set a pasta timer for 8 minutes", "HassStartTimer", ({"minutes": 8, "name": "pasta"},)),
    Command("Set a 30 second timer", "HassStartTimer", ({"seconds": 30},)),
    Command("Cancel the pasta timer", "HassCancelTimer", ({"name": "pasta"},)),
    Command("Put call the plumber on my to-do list", "HassListAddItem",
            ({"item": "call the plumber", "name": "To-do"},)),
    Command("What's the date today?", "HassGetCurrentDate"),
    Command("What's the temperature in the bedroom?", "GetLiveContext"),
    Command("Is the garage door open?", "GetLiveContext"),
    _on("Start the hoover", "HassVacuumStart", "Hoover"),
    _on("Turn off the office air purifier", "HassTurnOff", "Office Air Purifier"),
    Command("What is the capital of France?", None),
    Command("Tell me a fun fact about octopuses", None),
)


# ----------------------------------------------------------------------------- scoring

def looks_like_call(text: str) -> bool:
    """Text a client got back as words although the model meant a call (an unparsed call)."""
    return bool(CALL_START.match(text)) or HERMES_OPEN in text or bool(INLINE_CALL.search(text))


def norm_name(value: Any) -> Any:
    """A name as Home Assistant matches it: case, spaces, '_' and '-' do not matter."""
    return re.sub(r"[\s_\-]+", " ", value).strip().lower() if isinstance(value, str) else value


def _same(a: Any, b: Any, loose: bool) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(str, (norm_name(x) if loose else x for x in a))) == \
            sorted(map(str, (norm_name(x) if loose else x for x in b)))
    if loose:
        return norm_name(a) == norm_name(b)
    return a == b


def judge(cmd: Command, calls: list[tuple[str, dict]], content: str) -> dict[str, bool]:
    """Did the answer carry out ``cmd``? exact (names as listed) and name-insensitive."""
    unparsed = not calls and looks_like_call(content)
    if cmd.tool is None:
        ok = not calls and bool(content.strip()) and not unparsed
        return {"exact": ok, "loose": ok, "unparsed": unparsed, "wrong_tool": bool(calls), "no_call": False}
    if not calls:
        return {"exact": False, "loose": False, "unparsed": unparsed, "wrong_tool": False, "no_call": not unparsed}
    name, args = calls[0]
    if name != cmd.tool or len(calls) > 1:
        return {"exact": False, "loose": False, "unparsed": False, "wrong_tool": name != cmd.tool, "no_call": False}
    return {"exact": _args_ok(cmd, args, loose=False), "loose": _args_ok(cmd, args, loose=True),
            "unparsed": False, "wrong_tool": False, "no_call": False}


def _args_ok(cmd: Command, args: dict, loose: bool) -> bool:
    for want in cmd.args:
        if not all(k in args and _same(args[k], v, loose) for k, v in want.items()):
            continue
        extra = {k: v for k, v in args.items() if k not in want}
        if all(_extra_ok(cmd, k, v, loose) for k, v in extra.items()):
            return True
    return False


def _extra_ok(cmd: Command, key: str, value: Any, loose: bool) -> bool:
    """A slot the command did not need may still be sent if it says the same thing."""
    if key == "domain":
        return isinstance(value, list) and bool(value) and set(value) <= set(cmd.domains)
    if key == "area":
        return cmd.area is not None and _same(value, cmd.area, loose)
    return False
