"""h11's header field rules, checked over a whole header list at once.

h11 checks every header it is given with two regular expressions (the name a
``token``, the value ``field-value``: no NUL, no CR/LF or other whitespace
but inner spaces and tabs, none leading or trailing), one Python call and
one match each. The sidecar builds two heads a stream whose headers it
assembled itself from headers a parser already checked (the upstream request
and the client's response head); :func:`fields_valid` applies the same rules
to all names joined by a line feed and all values joined by one, with a few
byte-table and substring passes (``bytes.translate``, ``find``) instead of a
regular expression per field: a line feed is neither in a token nor in a
field value, so a joined list passes exactly when every field does. Where it says yes, h11 is
told the headers are checked (its ``_parsed`` flag); where it says no, h11
checks them itself and raises its own error, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

# h11/_abnf.py: field_name = token; field_value = (field_vchar+ ([ \t]+ field_vchar+)*)?
# with field_vchar = [^\x00\s] (bytes: \s is space, \t, \n, \r, \f, \v).
TOKEN_CHARS = b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The bytes of an HTTP token (a field name, a method)."""
# Every byte a value may hold somewhere (not NUL, LF, CR, VT, FF); space and
# tab only inside it, checked apart.
_VALUE_CHARS = bytes(c for c in range(256) if c not in b"\x00\n\r\x0b\x0c")


def fields_valid(headers: Sequence[tuple[object, object]]) -> bool:
    """True if h11 would accept every name and value of ``headers`` (each a
    ``bytes`` object: h11 takes other types through other paths, so anything
    else is a no; typed ``object`` so that compiled code checks it here
    rather than refusing it at the call)."""
    count = len(headers)
    if not count:
        return True
    names: list[bytes] = []
    values: list[bytes] = []
    for name, value in headers:
        if type(name) is not bytes or type(value) is not bytes:
            return False
        names.append(name)
        values.append(value)
    # Joined, each list keeps nothing but its line feeds once the allowed
    # bytes are deleted: one fewer than fields, or a field held one itself.
    separators = b"\n" * (count - 1)
    all_names = b"\n" + b"\n".join(names) + b"\n"
    all_values = b"\n" + b"\n".join(values) + b"\n"
    return (all_names.translate(None, TOKEN_CHARS) == b"\n" + separators + b"\n"
            and all_names.find(b"\n\n") < 0  # an empty name
            and all_values.translate(None, _VALUE_CHARS) == b"\n" + separators + b"\n"
            # Space or tab leading or trailing a value.
            and all_values.find(b"\n ") < 0 and all_values.find(b" \n") < 0
            and all_values.find(b"\n\t") < 0 and all_values.find(b"\t\n") < 0)
