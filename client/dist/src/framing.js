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
export function encode(message, framing) {
    const body = Buffer.from(JSON.stringify(message), "utf8");
    if (framing === "ndjson") {
        return Buffer.concat([body, NEWLINE]);
    }
    return Buffer.concat([Buffer.from(`Content-Length: ${body.length}\r\n\r\n`, "ascii"), body]);
}
const NEWLINE = Buffer.from("\n");
const HEADER_END = Buffer.from("\r\n\r\n");
const CONTENT_LENGTH = /^content-length:\s*(\d+)\s*$/im;
export class FrameDecoder {
    framing;
    maxMessageBytes;
    pending = [];
    pendingBytes = 0;
    /** Bytes of `pending` already searched for the end of the current header or line. */
    scanned = 0;
    bodyLength = null;
    constructor(framing, maxMessageBytes = 64 * 1024 * 1024) {
        this.framing = framing;
        this.maxMessageBytes = maxMessageBytes;
    }
    /** Feed bytes; returns the messages (and problems) they complete, in order. */
    push(chunk) {
        if (chunk.length > 0) {
            this.pending.push(chunk);
            this.pendingBytes += chunk.length;
        }
        const out = [];
        for (;;) {
            const item = this.framing === "ndjson" ? this.nextLine() : this.nextFrame();
            if (item === null) {
                return out;
            }
            if (item !== SKIPPED) {
                out.push(item);
            }
        }
    }
    /** Bytes received but not yet part of a whole message. */
    get buffered() {
        return this.pendingBytes;
    }
    nextLine() {
        const end = this.find(NEWLINE);
        if (end < 0) {
            if (this.pendingBytes > this.maxMessageBytes) {
                const head = this.take(this.pendingBytes);
                return problem(`a line longer than ${this.maxMessageBytes} bytes`, head);
            }
            return null;
        }
        const line = this.take(end + 1).subarray(0, end);
        const text = stripCr(line);
        if (text.length === 0) {
            return SKIPPED;
        }
        return parse(text);
    }
    nextFrame() {
        if (this.bodyLength === null) {
            const end = this.find(HEADER_END);
            if (end < 0) {
                return null;
            }
            const header = this.take(end + HEADER_END.length).toString("ascii");
            const match = CONTENT_LENGTH.exec(header);
            if (!match) {
                return problem("a header without Content-Length", Buffer.from(header, "ascii"));
            }
            this.bodyLength = Number(match[1]);
        }
        if (this.pendingBytes < this.bodyLength) {
            return null;
        }
        const body = this.take(this.bodyLength);
        this.bodyLength = null;
        return parse(body);
    }
    /** Offset of `needle` in the pending bytes, or -1; resumes where the last search stopped. */
    find(needle) {
        if (needle.length > 1 && this.pending.length > 1) {
            // Only headers are searched for a longer needle: they are short, so joining is cheap.
            this.pending = [Buffer.concat(this.pending)];
        }
        let offset = 0;
        for (const piece of this.pending) {
            const from = Math.max(0, this.scanned - offset - needle.length + 1);
            if (from < piece.length) {
                const at = piece.indexOf(needle, from);
                if (at >= 0) {
                    return offset + at;
                }
            }
            offset += piece.length;
        }
        this.scanned = offset;
        return -1;
    }
    take(count) {
        const all = this.pending.length === 1 ? this.pending[0] : Buffer.concat(this.pending);
        const taken = all.subarray(0, count);
        const rest = all.subarray(count);
        this.pending = rest.length > 0 ? [rest] : [];
        this.pendingBytes = rest.length;
        this.scanned = 0;
        return taken;
    }
}
const SKIPPED = Symbol("skipped");
function stripCr(line) {
    return line.length > 0 && line[line.length - 1] === 0x0d ? line.subarray(0, line.length - 1) : line;
}
function parse(bytes) {
    try {
        return { message: JSON.parse(bytes.toString("utf8")) };
    }
    catch (error) {
        return problem(`invalid JSON (${error.message})`, bytes);
    }
}
function problem(what, bytes) {
    return { problem: what, excerpt: bytes.subarray(0, 300).toString("utf8") };
}
//# sourceMappingURL=framing.js.map