/**
 * Framing of JSON-RPC messages on the worker's pipes, without I/O: encode a message,
 * and decode a byte stream (fed in pieces of any size) into messages.
 *
 * - `ndjson`: one JSON text per line.
 * - `lsp`: `Content-Length: N\r\n\r\n` then N bytes (the LSP base protocol).
 *
 * Bytes are kept until a whole message is there, so a multi-byte character split
 * across pipe reads is decoded whole, and a large message is copied once.
 */
export type Framing = "ndjson" | "lsp";
export declare function encode(message: unknown, framing: Framing): Buffer;
/** Something in the stream that is not a message; decoding goes on after it. */
export interface FramingProblem {
    problem: string;
    /** The offending bytes, cut to a few hundred, as text. */
    excerpt: string;
}
export type Decoded = {
    message: unknown;
} | FramingProblem;
export declare class FrameDecoder {
    private readonly framing;
    private readonly maxMessageBytes;
    private pending;
    private pendingBytes;
    /** Bytes of `pending` already searched for the end of the current header or line. */
    private scanned;
    private bodyLength;
    constructor(framing: Framing, maxMessageBytes?: number);
    /** Feed bytes; returns the messages (and problems) they complete, in order. */
    push(chunk: Buffer): Decoded[];
    /** Bytes received but not yet part of a whole message. */
    get buffered(): number;
    private nextLine;
    private nextFrame;
    /** Offset of `needle` in the pending bytes, or -1; resumes where the last search stopped. */
    private find;
    private take;
}
