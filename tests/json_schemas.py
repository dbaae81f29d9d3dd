"""Ten JSON Schemas of different shapes, for constrained output tests and the bench.

Every string, array and number is bounded, so that even a random model's constrained
output ends within the tests' max_tokens (a grammar decides which tokens may come, not when
a free string ends)."""

SCHEMAS: dict[str, dict] = {
    "flat_object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["id", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "array_of_strings": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"], "additionalProperties": False},
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1, "multipleOf": 0.01},
            "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 50},
        },
        "required": ["ratio", "count"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 8},
            "subtitle": {"type": "string", "maxLength": 8},
            "draft": {"type": "boolean"},
        },
        "required": ["title"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "maxLength": 5}, "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    "any_of": {
        "anyOf": [
            {"type": "object", "properties": {"ok": {"const": True}}, "required": ["ok"], "additionalProperties": False},
            {"type": "object", "properties": {"error": {"type": "string", "maxLength": 10}}, "required": ["error"], "additionalProperties": False},
        ]
    },
    "nullable_and_const": {
        "type": "object",
        "properties": {"version": {"const": 2}, "parent": {"type": ["integer", "null"], "minimum": 0, "maximum": 99}},
        "required": ["version", "parent"],
        "additionalProperties": False,
    },
    "definitions_ref": {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "y": {"type": "integer", "minimum": -9, "maximum": 9}}, "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },
}
