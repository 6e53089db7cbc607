"""The schemas of `bench.bench_structured`: 20 real-world extraction schemas (`SCHEMAS`), the
throughput workload's (`WORKLOAD_SCHEMA`) and batch 1's (`LONG_TEXT_SCHEMA`), written with a
few small builders."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]
DATE: Schema = {"type": "string", "format": "date"}
DATE_TIME: Schema = {"type": "string", "format": "date-time"}
EMAIL: Schema = {"type": "string", "format": "email"}
BOOLEAN: Schema = {"type": "boolean"}
CURRENCY: Schema = {"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]}


def text(max_length: int, min_length: int = 0) -> Schema:
    schema: Schema = {"type": "string", "maxLength": max_length}
    return schema | {"minLength": min_length} if min_length else schema


def pattern(regex: str) -> Schema:
    return {"type": "string", "pattern": regex}


def integer(minimum: int, maximum: int) -> Schema:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> Schema:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def enum(*values: str) -> Schema:
    return {"enum": list(values)}


def array(items: Schema, max_items: int, min_items: int = 0) -> Schema:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(**properties: Schema) -> Schema:
    """An object whose properties are all required, in this order."""
    return {"type": "object", "properties": properties, "required": list(properties)}


# fmt: off
# (Each schema kept to a few lines, as the document it describes reads; the formatter would give
# every field its own line.)
PARTY = obj(name=text(120), role=enum("buyer", "seller", "licensor", "licensee", "guarantor"))
ADDRESS = obj(
    street=text(120), city=text(60), region=text(60),
    postal_code=pattern(r"^[A-Z0-9][A-Z0-9 -]{2,9}$"), country=pattern(r"^[A-Z]{2}$"),
)
EMPLOYEE = obj(
    name=text(80), title=text(80), email=EMAIL, reports=array({"$ref": "#/$defs/employee"}, 8),
)
SCHEMAS: dict[str, Schema] = {
    "invoice": obj(
        invoice_number=pattern(r"^INV-[0-9]{4,10}$"), issue_date=DATE, due_date=DATE,
        vendor=obj(name=text(120), tax_id=pattern(r"^[A-Z]{2}[0-9A-Z]{8,12}$"), address=ADDRESS),
        line_items=array(obj(description=text(200), quantity=integer(1, 100000),
                             unit_price=number(0, 1e6), tax_rate=number(0, 0.5)), 50, 1),
        currency=CURRENCY, subtotal=number(0, 1e9), total=number(0, 1e9),
    ),
    "contract": obj(
        title=text(200), parties=array(PARTY, 6, 2), effective_date=DATE,
        term_months=integer(1, 240), governing_law=text(80),
        clauses=array(obj(kind=enum("payment", "confidentiality", "liability", "termination",
                                    "ip", "other"), summary=text(400)), 30),
        auto_renew=BOOLEAN, termination_notice_days=nullable(integer(0, 365)),
    ),
    "contact": obj(
        first_name=text(60), last_name=text(60), email=EMAIL,
        phone=pattern(r"^\+?[0-9 ()-]{7,20}$"), company=nullable(text(120)),
        job_title=nullable(text(120)), website={"type": "string", "format": "uri"},
    ),
    "address": ADDRESS | {"properties": ADDRESS["properties"] | {"kind": enum("home", "work")}},
    "product": obj(
        sku=pattern(r"^[A-Z]{3}-[0-9]{4,8}$"), name=text(150), description=text(1000),
        price=number(0, 1e6), currency=CURRENCY, categories=array(text(40), 5, 1),
        attributes=array(obj(name=text(40), value=text(80)), 20), in_stock=BOOLEAN,
        dimensions=obj(width_cm=number(0, 1000), height_cm=number(0, 1000),
                       weight_kg=number(0, 1e4)),
    ),
    "calendar_event": obj(
        title=text(200), start=DATE_TIME, end=DATE_TIME, location=nullable(text(200)),
        attendees=array(obj(name=text(80), email=EMAIL,
                            response=enum("accepted", "declined", "tentative")), 50),
        recurrence=enum("none", "daily", "weekly", "monthly", "yearly"),
        reminder_minutes=integer(0, 10080),
    ),
    "recipe": obj(
        name=text(120), servings=integer(1, 100), prep_minutes=integer(0, 1440),
        cook_minutes=integer(0, 1440),
        ingredients=array(obj(item=text(80), amount=number(0, 10000),
                              unit=enum("g", "kg", "ml", "l", "tsp", "cup", "piece")), 40, 1),
        steps=array(text(400), 30, 1), difficulty=enum("easy", "medium", "hard"),
    ),
    "github_issue": obj(
        title=text(256), body=text(4000),
        labels=array(enum("bug", "enhancement", "documentation", "question", "security"), 5),
        assignees=array(pattern(r"^[a-zA-Z0-9-]{1,39}$"), 10), state=enum("open", "closed"),
        milestone=nullable(text(100)), reproduction_steps=array(text(300), 20),
    ),
    "job_posting": obj(
        title=text(120), company=text(120),
        location=obj(city=text(60), country=pattern(r"^[A-Z]{2}$"),
                     remote=enum("no", "hybrid", "yes")),
        employment_type=enum("full_time", "part_time", "contract", "internship"),
        salary=obj(minimum=integer(0, 10**7), maximum=integer(0, 10**7), currency=CURRENCY,
                   period=enum("year", "month", "hour")),
        requirements=array(text(200), 20, 1), benefits=array(text(100), 20), posted=DATE,
    ),
    "medical_summary": obj(
        patient=obj(id=pattern(r"^P[0-9]{6,10}$"), age=integer(0, 120), sex=enum("F", "M", "X")),
        diagnoses=array(obj(code=pattern(r"^[A-Z][0-9]{2}(\.[0-9A-Z]{1,4})?$"),
                            description=text(200)), 20, 1),
        medications=array(obj(name=text(80), dose_mg=number(0, 10000),
                              frequency=enum("qd", "bid", "tid", "prn")), 30),
        allergies=array(text(60), 20),
        vitals=obj(heart_rate=integer(20, 250), systolic=integer(50, 260),
                   diastolic=integer(30, 160), temperature_c=number(30, 45)),
        follow_up=nullable(DATE),
    ),
    "flight_booking": obj(
        booking_reference=pattern(r"^[A-Z0-9]{6}$"),
        passengers=array(obj(first_name=text(60), last_name=text(60), date_of_birth=DATE,
                             seat=nullable(pattern(r"^[0-9]{1,2}[A-K]$"))), 9, 1),
        segments=array(obj(flight_number=pattern(r"^[A-Z0-9]{2}[0-9]{1,4}$"),
                           origin=pattern(r"^[A-Z]{3}$"), destination=pattern(r"^[A-Z]{3}$"),
                           departure=DATE_TIME, arrival=DATE_TIME,
                           cabin=enum("economy", "premium", "business", "first")), 6, 1),
        total_price=number(0, 1e6), currency=CURRENCY,
    ),
    "bank_transactions": obj(
        iban=pattern(r"^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"),
        transactions=array(obj(date=DATE, description=text(140), amount=number(-1e7, 1e7),
                               category=enum("income", "groceries", "rent", "transport",
                                             "utilities", "other"),
                               counterparty=nullable(text(120))), 100),
        closing_balance=number(-1e9, 1e9),
    ),
    "log_event": obj(
        timestamp=DATE_TIME, level=enum("TRACE", "DEBUG", "INFO", "WARN", "ERROR", "FATAL"),
        service=pattern(r"^[a-z][a-z0-9-]{0,62}$"), message=text(2000),
        trace_id=pattern(r"^[0-9a-f]{32}$"), span_id=pattern(r"^[0-9a-f]{16}$"),
        http=nullable(obj(method=enum("GET", "POST", "PUT", "PATCH", "DELETE"), path=text(300),
                          status=integer(100, 599), duration_ms=number(0, 600000))),
    ),
    "classification": obj(
        sentiment=enum("positive", "negative", "neutral", "mixed"), confidence=number(0, 1),
        topics=array(enum("billing", "shipping", "quality", "support", "pricing", "other"), 3, 1),
        is_urgent=BOOLEAN, rationale=text(280),
    ),
    "named_entities": obj(
        entities=array(obj(text=text(100), label=enum("PERSON", "ORG", "LOC", "DATE", "MONEY",
                                                      "PRODUCT", "EVENT"),
                           start=integer(0, 100000), end=integer(0, 100000)), 100),
    ),
    "table_rows": obj(
        rows=array(obj(company=text(120), ticker=pattern(r"^[A-Z]{1,5}$"),
                       fiscal_year=integer(1900, 2100), revenue_musd=number(0, 1e7),
                       net_income_musd=number(-1e6, 1e7), employees=nullable(integer(0, 10**7)),
                       sector=enum("tech", "finance", "health", "energy", "consumer")), 200, 1),
    ),
    "org_chart": {
        "$defs": {"employee": EMPLOYEE},
        **obj(company=text(120), ceo={"$ref": "#/$defs/employee"}),
    },
    "api_error": obj(
        error=obj(code=enum("invalid_request", "unauthorized", "forbidden", "not_found",
                            "rate_limited"),
                  message=text(500), status=integer(400, 599),
                  details=array(obj(field=text(100), reason=text(200),
                                    location=enum("body", "query", "path")), 20),
                  request_id={"type": "string", "format": "uuid"}),
    ),
    "config_file": obj(
        service=obj(name=pattern(r"^[a-z][a-z0-9-]{1,40}$"),
                    version=pattern(r"^[0-9]+\.[0-9]+\.[0-9]+$"), port=integer(1, 65535),
                    log_level=enum("debug", "info", "warning", "error")),
        database=obj(host={"type": "string", "format": "hostname"}, port=integer(1, 65535),
                     name=text(63), pool_size=integer(1, 200), ssl=BOOLEAN),
        features=array(obj(name=text(60), enabled=BOOLEAN, rollout_percent=integer(0, 100)), 50),
        timeout_s=number(0, 3600),
    ),
    "openapi_endpoint": obj(
        path=pattern(r"^/[a-z0-9/{}_-]*$"), method=enum("GET", "POST", "PUT", "PATCH", "DELETE"),
        operation_id=pattern(r"^[a-zA-Z][a-zA-Z0-9_]{0,63}$"), summary=text(200),
        parameters=array(obj(name=text(60), location=enum("path", "query", "header", "cookie"),
                             required=BOOLEAN,
                             type=enum("string", "integer", "number", "boolean", "array")), 20),
        request_body=nullable(obj(content_type=enum("application/json", "text/plain"),
                                  ref=text(100))),
        responses=array(obj(status=pattern(r"^[1-5][0-9]{2}$"), description=text(200),
                            ref=nullable(text(100))), 10, 1),
    ),
}
# The throughput workload's schema: long answers (strings, an array of objects, enums, bounded
# integers), so that most requests end at their length, as the free run's do. No `number`: its
# bounds bound the value, not the digits, and random weights write fractions of 100+ digits.
WORKLOAD_SCHEMA = obj(
    customer=text(80), status=enum("pending", "paid", "shipped", "cancelled"),
    items=array(obj(sku=pattern(r"^[A-Z]{3}-[0-9]{4}$"), description=text(160),
                    quantity=integer(1, 99), unit_price_cents=integer(0, 10**6)), 12, 6),
    notes=text(400),
)
# fmt: on
LONG_TEXT_SCHEMA = obj(text=text(400, 400))  # batch 1: every step is a decode in a string
