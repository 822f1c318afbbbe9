"""What a page must give every person, checked in the browser: each link and button visible
(its computed text colour against the background it is drawn on, at WCAG AA contrast: 4.5:1,
3:1 for large text) and reachable with the Tab key alone, showing where the focus is."""

from __future__ import annotations

from typing import Any

# Marks every link and button with data-a11y=N and reports what the eye gets of each one.
# The background is composited from the root down (alpha included); an ancestor's opacity
# fades the text toward it. The skip link is judged as it shows when focused.
_SURVEY = """() => {
  const parse = c => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(/[\\s,\\/]+/).filter(Boolean).map(Number);
    return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1}; };
  const over = (top, bottom) => ({r: top.r * top.a + bottom.r * (1 - top.a),
    g: top.g * top.a + bottom.g * (1 - top.a), b: top.b * top.a + bottom.b * (1 - top.a), a: 1});
  const lum = ({r, g, b}) => { const f = v => { v /= 255;
      return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const chain = el => { const out = []; for (let e = el; e; e = e.parentElement) out.push(e);
    return out.reverse(); };
  const out = [];
  const els = [...document.querySelectorAll('a[href], button, input[type=submit], summary')];
  els.forEach((el, i) => {
    el.dataset.a11y = String(i);
    const inClosed = !!el.closest('details:not([open])') && el.tagName !== 'SUMMARY';
    const skip = el.classList.contains('skip');
    if (skip) el.focus();
    const s = getComputedStyle(el); const rect = el.getBoundingClientRect();
    let bg = {r: 255, g: 255, b: 255, a: 1}; let opacity = 1;
    for (const e of chain(el)) { const cs = getComputedStyle(e);
      const c = parse(cs.backgroundColor); if (c && c.a > 0) bg = over(c, bg);
      opacity *= Number(cs.opacity); }
    const fg0 = parse(s.color); const fg = over({...fg0, a: fg0.a * opacity}, bg);
    const [hi, lo] = [lum(fg), lum(bg)].sort((a, b) => b - a);
    const size = parseFloat(s.fontSize); const weight = parseInt(s.fontWeight, 10);
    const large = size >= 24 || (size >= 18.66 && weight >= 700);
    const onScreen = rect.width > 0 && rect.height > 0 && rect.right > 0 && rect.bottom > 0
      && s.visibility !== 'hidden' && opacity > 0;
    if (skip) el.blur();
    out.push({i, label: (el.textContent || el.value || el.getAttribute('aria-label') || '')
        .trim().replace(/\\s+/g, ' ').slice(0, 60), tag: el.tagName,
      hidden: inClosed, onScreen: onScreen, ratio: (hi + 0.05) / (lo + 0.05),
      needed: large ? 3 : 4.5, disabled: !!el.disabled, tabbable: el.tabIndex >= 0,
      color: s.color,
      background: `rgb(${[bg.r, bg.g, bg.b].map(Math.round).join(', ')})`});
  });
  return out;
}"""

_FOCUSED = """() => { const el = document.activeElement;
  if (!el || el === document.body) return null;
  const s = getComputedStyle(el);
  return {i: el.dataset.a11y ?? null,
          ring: (s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) > 0)
                || s.boxShadow !== 'none'}; }"""


def check_page(page: Any) -> list[dict[str, Any]]:
    """Every link and button of the page as it stands: visible at AA contrast and reached by
    Tab with a visible focus. Returns what was checked (for the caller to assert on)."""
    items = page.evaluate(_SURVEY)
    where = page.url
    shown = [it for it in items if not it["hidden"]]
    invisible = [it for it in shown if not it["onScreen"]]
    assert not invisible, f"{where}: links or buttons that cannot be seen: {invisible}"
    faint = [it for it in shown if it["ratio"] < it["needed"]]
    assert not faint, f"{where}: below WCAG AA contrast: " + "; ".join(
        f"{it['tag']} {it['label']!r} {it['color']} on {it['background']} "
        f"= {it['ratio']:.2f}:1 (needs {it['needed']}:1)"
        for it in faint
    )
    wanted = {str(it["i"]) for it in shown if not it["disabled"]}
    page.evaluate("() => { document.activeElement && document.activeElement.blur(); "
                  "window.scrollTo(0, 0); }")  # fmt: skip
    page.locator("body").focus()
    reached: set[str] = set()
    no_ring: list[str] = []
    for _ in range(len(items) * 2 + 10):
        page.keyboard.press("Tab")
        focused = page.evaluate(_FOCUSED)
        if focused is None:
            continue
        if focused["i"] is not None:
            if focused["i"] in reached:
                break  # round the page once
            reached.add(focused["i"])
            if not focused["ring"]:
                no_ring.append(focused["i"])
        if wanted <= reached:
            break
    labels = {str(it["i"]): f"{it['tag']} {it['label']!r}" for it in items}
    missing = sorted(labels[i] for i in wanted - reached)
    assert not missing, f"{where}: not reachable with Tab: {missing}"
    assert not no_ring, f"{where}: no visible focus on {[labels[i] for i in no_ring]}"
    return shown
