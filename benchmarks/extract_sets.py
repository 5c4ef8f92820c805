"""Labelled extraction sets with their true values, built here (deterministic: the same seed, the same items), for
``benchmarks/extract_quality.py``:

- ``contacts``: a person's name, company, e-mail, phone, city and country (spans of the text), and a role from an
  enum that the text says in other words ("heads the sales team" -> ``sales``); the phone is absent from about a
  fifth of the texts (its true value null).
- ``orders``: an order's id, customer and product (spans), its quantity (digits or a number word -> an integer),
  its unit price (a number), its currency (a symbol or a word -> an ISO code from an enum) and its date (written as
  a reader would -> ``YYYY-MM-DD``); the id is absent from about a fifth (null).

Each item is ``{"text", "truth"}``; ``SCHEMAS`` gives each set's schema (with field descriptions), ``SPANS`` which
of its fields are spans of the text. ``normalise`` is the comparison both sides are judged by.
"""

from __future__ import annotations

import random
import re
import unicodedata
from typing import Any

FIRST = ["Ana", "Kemal", "Lena", "Jonas", "Priya", "Tomas", "Mei", "Omar", "Sofia", "Lukas", "Amara", "Diego",
         "Hana", "Pavel", "Ines", "Kwame", "Elif", "Mateo", "Yara", "Felix", "Noor", "Ravi", "Clara", "Sven"]
LAST = ["Lima", "Okafor", "Novak", "Silva", "Raman", "Berg", "Chen", "Haddad", "Rossi", "Weber", "Mensah",
        "Torres", "Sato", "Dvorak", "Costa", "Boateng", "Yilmaz", "Garcia", "Nasser", "Klein", "Aziz", "Iyer",
        "Moreau", "Lund"]
COMPANIES = ["Northwind Traders", "Bluefin Analytics", "Copperleaf Labs", "Harbor & Pine", "Quartz Logistics",
             "Sunridge Foods", "Vantage Robotics", "Meadowbrook Health", "Ironclad Security", "Tidewater Energy",
             "Lumen Textiles", "Orbit Media"]
PLACES = [("Porto", "Portugal"), ("Nairobi", "Kenya"), ("Graz", "Austria"), ("Leeds", "United Kingdom"),
          ("Pune", "India"), ("Lyon", "France"), ("Osaka", "Japan"), ("Accra", "Ghana"), ("Valencia", "Spain"),
          ("Tampere", "Finland"), ("Curitiba", "Brazil"), ("Brno", "Czech Republic")]
ROLES = {"engineer": ["is a software engineer", "builds their backend systems", "works as an engineer"],
         "manager": ["manages the operations team", "is the project manager", "runs the team as its manager"],
         "sales": ["heads the sales team", "is an account executive in sales", "sells their services"],
         "support": ["answers customer support tickets", "works in customer support", "leads the help desk"],
         "founder": ["founded the company", "is its co-founder", "started the firm"],
         "designer": ["designs their products", "is the lead designer", "works as a UX designer"]}
CONTACT_FORMS = [
    "Met {name} at the {city} fair; {he} {role} at {company}. Write to {email} or call {phone}. Based in {city}, "
    "{country}.",
    "{name} ({company}, {city}, {country}) {role}. Contact: {email}, phone {phone}.",
    "Please add {name} to the list: {he} {role} at {company} in {city} ({country}); e-mail {email}, tel. {phone}.",
    "From the conference in {city}, {country}: {name} of {company}, who {role}. Reach {him} at {email} or {phone}.",
]
CONTACT_FORMS_NO_PHONE = [
    "Met {name} at the {city} fair; {he} {role} at {company}. Write to {email}. Based in {city}, {country}.",
    "{name} ({company}, {city}, {country}) {role}. Contact: {email}; no phone given.",
    "From the conference in {city}, {country}: {name} of {company}, who {role}. Reach {him} at {email}.",
]
PRODUCTS = ["steel hinges", "oak desk", "LED panel", "ceramic mugs", "wireless mouse", "yoga mats", "copper wire",
            "printer toner", "garden hose", "office chairs", "paper rolls", "USB cables"]
CURRENCIES = {"EUR": ["€{p}", "{p} euros", "EUR {p}"], "USD": ["${p}", "{p} US dollars", "USD {p}"],
              "GBP": ["£{p}", "{p} pounds", "GBP {p}"]}
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 8: "eight", 10: "ten", 12: "twelve"}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
ORDER_FORMS = [
    "Order {order_id} from {customer}: {qty} {product} at {price} each, placed on {date}.",
    "{customer} ordered {qty} {product} ({price} per unit) on {date}; reference {order_id}.",
    "On {date}, {customer} placed order {order_id} for {qty} {product}, unit price {price}.",
    "Invoice for {customer}, order {order_id}, dated {date}: {product} x {qty} at {price} apiece.",
]
ORDER_FORMS_NO_ID = [
    "{customer} ordered {qty} {product} ({price} per unit) on {date}; no order number yet.",
    "On {date}, {customer} asked for {qty} {product} at {price} each.",
]

SCHEMAS: dict[str, dict[str, Any]] = {
    "contacts": {"type": "object", "additionalProperties": False,
                 "required": ["name", "company", "email", "phone", "city", "country", "role"],
                 "properties": {
                     "name": {"type": "string", "description": "The person's full name"},
                     "company": {"type": "string", "description": "The company the person works for"},
                     "email": {"type": "string", "description": "The person's e-mail address"},
                     "phone": {"type": ["string", "null"], "description": "The phone number, null if none"},
                     "city": {"type": "string", "description": "The city the person is based in"},
                     "country": {"type": "string", "description": "The country of that city"},
                     "role": {"type": "string", "enum": sorted(ROLES), "description": "What the person does"}}},
    "orders": {"type": "object", "additionalProperties": False,
               "required": ["order_id", "customer", "product", "quantity", "unit_price", "currency", "date"],
               "properties": {
                   "order_id": {"type": ["string", "null"], "description": "The order's reference, null if none"},
                   "customer": {"type": "string", "description": "Who placed the order"},
                   "product": {"type": "string", "description": "What was ordered"},
                   "quantity": {"type": "integer", "minimum": 1, "description": "How many units"},
                   "unit_price": {"type": "number", "minimum": 0, "description": "The price of one unit"},
                   "currency": {"type": "string", "enum": sorted(CURRENCIES), "description": "ISO currency code"},
                   "date": {"type": "string", "format": "date", "description": "The order's date, YYYY-MM-DD"}}},
}
SPANS = {"contacts": ("name", "company", "email", "phone", "city", "country"),
         "orders": ("order_id", "customer", "product")}


def _contact(rng: random.Random) -> dict[str, Any]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    company = rng.choice(COMPANIES)
    city, country = rng.choice(PLACES)
    role = rng.choice(sorted(ROLES))
    domain = re.sub(r"[^a-z]", "", company.lower().split()[0]) + rng.choice([".com", ".org", ".net", ".io"])
    email = f"{first.lower()}.{last.lower()}@{domain}"
    phone = f"+{rng.randint(30, 99)} {rng.randint(100, 999)} {rng.randint(100, 999)} {rng.randint(1000, 9999)}"
    has_phone = rng.random() >= 0.2
    he, him = rng.choice([("she", "her"), ("he", "him"), ("they", "them")])
    form = rng.choice(CONTACT_FORMS if has_phone else CONTACT_FORMS_NO_PHONE)
    role_text = rng.choice(ROLES[role])
    if he == "they":  # "they is" -> "they are"
        role_text = role_text.replace("is ", "are ", 1).replace("works ", "work ", 1).replace("runs ", "run ", 1) \
            .replace("heads ", "head ", 1).replace("answers ", "answer ", 1).replace("leads ", "lead ", 1) \
            .replace("builds ", "build ", 1).replace("manages ", "manage ", 1).replace("sells ", "sell ", 1) \
            .replace("designs ", "design ", 1)
    text = form.format(name=f"{first} {last}", company=company, city=city, country=country, email=email,
                       phone=phone, he=he.capitalize() if form.startswith("{he}") else he, him=him, role=role_text)
    return {"text": text, "truth": {"name": f"{first} {last}", "company": company, "email": email,
                                    "phone": phone if has_phone else None, "city": city, "country": country,
                                    "role": role}}


def _order(rng: random.Random) -> dict[str, Any]:
    customer = rng.choice(COMPANIES)
    product = rng.choice(PRODUCTS)
    qty = rng.choice([1, 2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 24, 50, 100])
    qty_text = NUMBER_WORDS[qty] if qty in NUMBER_WORDS and rng.random() < 0.4 else str(qty)
    price = round(rng.choice([0.5, 1, 2.5, 4.99, 12, 19.9, 35, 49.5, 120, 249, 899]) * rng.choice([1, 1, 2]), 2)
    currency = rng.choice(sorted(CURRENCIES))
    price_text = rng.choice(CURRENCIES[currency]).format(p=f"{price:.2f}" if price != int(price) else str(int(price)))
    year, month, day = rng.choice([2024, 2025, 2026]), rng.randint(1, 12), rng.randint(1, 28)
    date_text = rng.choice([f"{MONTHS[month - 1]} {day}, {year}", f"{day} {MONTHS[month - 1]} {year}",
                            f"{day} {MONTHS[month - 1][:3]} {year}"])
    has_id = rng.random() >= 0.2
    order_id = f"{rng.choice('ABCKPQ')}-{rng.randint(10000, 99999)}"
    form = rng.choice(ORDER_FORMS if has_id else ORDER_FORMS_NO_ID)
    text = form.format(order_id=order_id, customer=customer, qty=qty_text, product=product, price=price_text,
                       date=date_text)
    return {"text": text, "truth": {"order_id": order_id if has_id else None, "customer": customer,
                                    "product": product, "quantity": qty, "unit_price": price, "currency": currency,
                                    "date": f"{year:04d}-{month:02d}-{day:02d}"}}


def build(name: str, n: int = 120, seed: int = 46) -> list[dict[str, Any]]:
    """``n`` items of the set ``name`` (the same every time for the same seed)."""
    rng = random.Random(f"{name}-{seed}")
    make = {"contacts": _contact, "orders": _order}[name]
    return [make(rng) for _ in range(n)]


def normalise(field: str, value: Any) -> Any:
    """What a value is compared as: strings case-folded, accents and outer punctuation and spaces removed, inner
    spaces collapsed; a phone by its digits; numbers as floats; an empty string as null."""
    if value is None:
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    text = unicodedata.normalize("NFKD", str(value)).encode("ascii", "ignore").decode()
    text = re.sub(r"\s+", " ", text).strip(" .,;:!?\"'()").casefold()
    if field == "phone":
        text = re.sub(r"\D", "", text)
    if field in ("quantity", "unit_price"):
        try:
            return float(text)
        except ValueError:
            return text
    return text or None


def right(field: str, predicted: dict[str, Any] | None, truth: dict[str, Any]) -> bool:
    got = None if not isinstance(predicted, dict) else predicted.get(field)
    return normalise(field, got) == normalise(field, truth[field])
