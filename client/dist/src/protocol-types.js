// Generated from schemas/ by `npm run types` (client/scripts/schema-types.mjs): do not edit.
// After changing the protocol's structs, run `make schemas` (which also runs this).
/** The protocol version these types describe (schemas/index.json). */
export const PROTOCOL_VERSION = "1.0";
//# sourceMappingURL=protocol-types.js.map