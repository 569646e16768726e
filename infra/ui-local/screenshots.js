// Screenshots of the local Metaflow UI in headless Chromium (Debian's /usr/bin/chromium), driven
// by playwright-core (npm) so that pages can finish loading (the UI renders client-side, cards
// in iframes). Usage (infra/README.md):
//   NODE_PATH=infra/ui-local/.state/shot/node_modules node infra/ui-local/screenshots.js \
//     <out dir> <name>=<path or URL>[#<section heading to scroll to>] ...
const { chromium } = require('playwright-core');

const BASE = process.env.UI_URL || 'http://127.0.0.1:8083';

(async () => {
  const [out, ...shots] = process.argv.slice(2);
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
    args: ['--no-sandbox'],
  });
  const page = await browser.newPage({ viewport: { width: 1400, height: Number(process.env.SHOT_HEIGHT || 900) } });
  for (const shot of shots) {
    const eq = shot.indexOf('=');
    const name = shot.slice(0, eq);
    let [path, anchor] = shot.slice(eq + 1).split('#');
    const url = path.startsWith('http') ? path : BASE + path;
    await page.goto(url, { waitUntil: 'networkidle' });
    await page.waitForTimeout(4000);
    if (anchor) {
      // scroll the section whose heading is exactly `anchor` (e.g. "Card ID: lineage") to the
      // top, below the page's sticky header, and give the card's iframe time to render
      const scroll = (text) => {
        const hits = [...document.querySelectorAll('body *')].filter(
          (el) => el.children.length === 0 && el.textContent.trim() === text);
        if (!hits.length) return false;
        hits[hits.length - 1].scrollIntoView({ block: 'start' });
        window.scrollBy(0, -130);
        return true;
      };
      await page.waitForFunction(scroll, anchor, { timeout: 60000 }).catch((e) => console.log(name, e.message));
      await page.waitForTimeout(8000);     // logs and the card's iframe load and move the page
      await page.evaluate(scroll, anchor);
      await page.waitForTimeout(2000);
      // the section from its heading down (the page may end before the heading reaches the top):
      // the breadcrumb bar, then the card
      const y = await page.evaluate((text) => {
        const hits = [...document.querySelectorAll('body *')].filter(
          (el) => el.children.length === 0 && el.textContent.trim() === text);
        return hits[hits.length - 1].getBoundingClientRect().top + window.scrollY;
      }, anchor);
      const h = page.viewportSize().height;
      const full = await page.evaluate(() => document.documentElement.scrollHeight);
      await page.evaluate(() => window.scrollTo(0, 0));
      await page.screenshot({ path: `${out}/${name}.png`, fullPage: true,
        clip: { x: 0, y: y - 20, width: 1400, height: Math.min(h, full - (y - 20)) } });
      console.log(`${out}/${name}.png <- ${url} (section "${anchor}")`);
      continue;
    }
    await page.screenshot({ path: `${out}/${name}.png` });
    console.log(`${out}/${name}.png <- ${url}`);
  }
  await browser.close();
})();
