"""JSON schemas, regexes and an EBNF grammar for the structured-output tests (outputs bounded in length)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

SCHEMAS: dict[str, dict] = {
    "person": {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                                       "maximum": 120}},
               "required": ["name", "age"]},
    "address": {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 24}, "city": NAME,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["street", "city", "zip"]},
    "tags": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                       "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "color_enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                   "required": ["color"]},
    "temperature_range": {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                                                                       "maximum": 50}},
                          "required": ["celsius"]},
    "optional_note": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                                       "note": {"type": "string", "maxLength": 12}},
                      "required": ["id"]},
    "ref_points": {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {"type": "integer", "minimum": -99,
                                                                      "maximum": 99}},
        "required": ["x", "y"]}},
        "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"]},
    "code_pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
                     "required": ["code"]},
    "flags": {"type": "object", "properties": {"active": {"type": "boolean"},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["active", "count"]},
    "order_items": {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "minItems": 1,
                                                               "items": {"type": "object", "properties": {
                                                                   "name": {"type": "string", "maxLength": 10},
                                                                   "qty": {"type": "integer", "minimum": 1,
                                                                           "maximum": 9}},
                                                                   "required": ["name", "qty"]}}},
                    "required": ["items"]},
    "nested_three": {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    "int_enum": {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}}, "required": ["level"]},
    "const_version": {"type": "object", "properties": {"version": {"const": "1.0"}, "ok": {"type": "boolean"}},
                      "required": ["version", "ok"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 50}, {"type": "string", "maxLength": 5}]}},
        "required": ["value"]},
    "scores": {"type": "object", "properties": {"scores": {"type": "array", "minItems": 1, "maxItems": 4,
                                                           "items": {"type": "integer", "minimum": 0,
                                                                     "maximum": 100}}},
               "required": ["scores"]},
    "nullable": {"type": "object", "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}},
                 "required": ["nickname"]},
    "top_level_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                        "minItems": 2, "maxItems": 4},
    "book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "authors": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2025}}, "required": ["title", "authors", "year"]},
    "ticket": {"type": "object", "properties": {"status": {"enum": ["open", "closed", "pending"]},
                                                "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
               "required": ["status", "priority"]},
    "exclusive_bounds": {"type": "object", "properties": {"ratio": {"type": "integer", "exclusiveMinimum": 0,
                                                                    "exclusiveMaximum": 10}},
                         "required": ["ratio"]},
    "username": {"type": "object", "properties": {"username": {"type": "string", "minLength": 3, "maxLength": 12,
                                                                "pattern": "^[a-z]+$"}},
                 "required": ["username"]},
    "matrix": {"type": "object", "properties": {"rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"]},
    "product_with_defs": {"$defs": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                    "sku": {"type": "string", "pattern": "^SKU[0-9]{4}$"}},
                          "type": "object", "properties": {"sku": {"$ref": "#/$defs/sku"},
                                                           "price": {"$ref": "#/$defs/price"},
                                                           "in_stock": {"type": "boolean"}},
                          "required": ["sku", "price", "in_stock"]},
}

REGEXES: dict[str, str] = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "date": r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z]{3,10}@[a-z]{3,8}\.(com|org|net)",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "hex_color": r"#[0-9a-fA-F]{6}",
    "colors": r"(red|green|blue)( (red|green|blue)){0,3}",
}

ARITHMETIC_EBNF = r"""
root ::= "Answer: " expr
expr ::= term (op term)? (op term)?
op ::= " + " | " - " | " * "
term ::= num | "(" num " + " num ")"
num ::= [1-9] [0-9]?
"""
ARITHMETIC_REGEX = r"Answer: (T)(( \+ | - | \* )(T))?(( \+ | - | \* )(T))?".replace(
    "T", r"[1-9][0-9]?|\([1-9][0-9]? \+ [1-9][0-9]?\)")
